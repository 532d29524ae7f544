"""A comm stage plugin: each batch is one file in a directory (``plugins.comm: example-comm``)."""

import os
import shutil
import tempfile
import time

import torch

from mrl_plugins.hookspecs import Capabilities, StagePlugin, hookimpl

CAPS = Capabilities(rejoinable=True)  # a restarted worker writes into the same directory


class Batch:
    """One received batch (an ``Experience``): the file is gone already, so ``release`` has nothing to do."""

    def __init__(self, meta, batch):
        self.meta, self.batch = meta, batch

    def release(self):
        pass


class DirProducer:
    """Worker side: ``torch.save`` to a temporary name, then an atomic rename the consumer picks up."""

    capabilities = CAPS

    def __init__(self, folder, index):
        self.folder, self.index, self.sent = folder, index, 0

    def send(self, batch, meta, timeout=None):
        name = f"{time.time_ns():020d}-{self.index}-{self.sent}.pt"
        tmp = os.path.join(self.folder, "." + name)
        torch.save((dict(meta), dict(batch)), tmp)
        os.replace(tmp, os.path.join(self.folder, name))
        self.sent += 1
        return os.path.getsize(os.path.join(self.folder, name))

    def close(self):
        pass


class DirConsumer:
    """Trainer side: the oldest file first; ``TimeoutError`` when none arrives in time."""

    capabilities = CAPS

    def __init__(self, run_id, producers):
        self.folder = tempfile.mkdtemp(prefix=f"mrl-example-comm-{run_id}-")
        self.producers, self.received = producers, 0

    def producer_handle(self, index):
        return (self.folder, index)  # picklable: a worker opens its producer from it

    def receive(self, timeout=None):
        deadline = time.monotonic() + (60.0 if timeout is None else timeout)
        while True:
            names = sorted(n for n in os.listdir(self.folder) if not n.startswith("."))
            if names:
                path = os.path.join(self.folder, names[0])
                meta, batch = torch.load(path, weights_only=True)
                os.remove(path)
                self.received += 1
                return Batch(meta, batch)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"example-comm: no batch within {timeout} s")
            time.sleep(0.005)

    def stats(self):
        return {"received": self.received}

    def close(self):
        shutil.rmtree(self.folder, ignore_errors=True)


class DirComm:
    """The stage (a ``CommStage``): what its ends can do, and opening them."""

    def capabilities(self, ctx):
        return CAPS

    def open_consumer(self, ctx, run_id, producers):
        return DirConsumer(run_id, producers)

    def open_producer(self, ctx, handle, index):
        folder, index = handle
        return DirProducer(folder, index)


class ExampleComm:
    """The plugin: registers the stage under the name a config selects."""

    @hookimpl
    def mrl_comm_register_stages(self):
        return [StagePlugin("example-comm", DirComm, "each batch one file in a directory")]


plugin = ExampleComm()
