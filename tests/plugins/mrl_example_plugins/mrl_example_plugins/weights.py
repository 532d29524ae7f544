"""A weight-sync stage plugin: each version is one file plus a ``latest`` pointer (``plugins.weight_sync:
example-weights``). The receiver stages a version in host memory and copies it into the model at the switch."""

import contextlib
import os
import shutil
import tempfile
import time

import torch

from mrl_plugins.hookspecs import Capabilities, PublishReport, StagePlugin, SwitchReport, hookimpl

CAPS = Capabilities(rejoinable=True)


class FileSender:
    capabilities = CAPS

    def __init__(self, model_id, run_id):
        self.model_id = model_id
        self.folder = tempfile.mkdtemp(prefix=f"mrl-example-weights-{run_id}-{model_id}-")
        self.published = 0

    def publish(self, version, named_tensors):
        start = time.perf_counter()
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in named_tensors}
        torch.save(tensors, os.path.join(self.folder, f"v{version}.pt"))
        with open(os.path.join(self.folder, ".latest"), "w") as f:
            f.write(str(version))
        os.replace(os.path.join(self.folder, ".latest"), os.path.join(self.folder, "latest"))
        self.published += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return PublishReport(self.model_id, version, nbytes, time.perf_counter() - start)

    def receiver_handle(self):
        return self.folder

    def stats(self):
        return {"published": self.published}

    def close(self):
        shutil.rmtree(self.folder, ignore_errors=True)


class FileReceiver:
    capabilities = CAPS

    def __init__(self, model, folder, model_id):
        self.model, self.folder, self.model_id = model, folder, model_id
        self.version = -1
        self.staged = None

    def poll(self, timeout):
        try:
            with open(os.path.join(self.folder, "latest")) as f:
                latest = int(f.read())
        except FileNotFoundError:
            return None
        if latest <= self.version:
            return None
        self.staged = (latest, torch.load(os.path.join(self.folder, f"v{latest}.pt"), weights_only=True))
        return latest

    def switch(self, timeout=None):
        if self.staged is None:
            return None
        start = time.perf_counter()
        (version, tensors), self.staged = self.staged, None
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        report = SwitchReport(self.model_id, self.version, version, nbytes, time.perf_counter() - start)
        self.version = version
        return report

    def active(self):
        return contextlib.nullcontext(self.model)  # switches run between requests: nothing to guard here

    def stats(self):
        return {"version": self.version}

    def close(self):
        self.staged = None


class FileWeights:
    def capabilities(self, ctx):
        return CAPS

    def open_sender(self, ctx, model_id, run_id, receivers, same_process):
        return FileSender(model_id, run_id)

    def open_receiver(self, ctx, model, handle, model_id, rank):
        return FileReceiver(model, handle, model_id)


class ExampleWeights:
    @hookimpl
    def mrl_weight_sync_register_stages(self):
        return [StagePlugin("example-weights", FileWeights, "safetensors files, one per version")]


plugin = ExampleWeights()
