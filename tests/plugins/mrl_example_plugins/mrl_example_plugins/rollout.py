"""A rollout stage plugin: generation on a copy of the policy inside the trainer process (``plugins.rollout:
example-rollout``), with the built-in ``transformers`` engine from the registry. Its weights arrive through the
weight-sync stage's ends, whichever plugin runs that stage: it opens a sender and an in-process receiver."""

import os

from mrl_plugins.hookspecs import RolloutResult, StagePlugin, hookimpl
from mrl_plugins.weight_sync.sources import inference_copy


class ExampleRuntime:
    replaces_host = True  # TRL generates through this runtime

    def __init__(self, ctx, setup):
        self.ctx = ctx
        self.model = inference_copy(setup.model)  # a separate copy, built for inference (KV cache, no checkpointing)
        pm = ctx.plugins
        self.sender = pm.weight_sync_open_sender(
            ctx=ctx, model_id="policy", run_id=f"example{os.getpid()}", receivers=1, same_process=True
        )
        self.receiver = pm.weight_sync_open_receiver(
            ctx=ctx, model=self.model, handle=self.sender.receiver_handle(), model_id="policy", rank=0
        )
        engine = pm.backend("mrl_rollout_register_engines", "transformers").factory
        self.engine = engine(self.model, None, params=setup.sampling, device="cpu", seed=setup.seed)

    def publish(self, version, named_tensors):
        return self.sender.publish(version, named_tensors)

    def generate(self, prompts, num_generations, model_id):
        timeout = self.ctx.config.weight_sync.timeout_s
        if self.receiver.poll(timeout) is not None:
            self.receiver.switch(timeout)
        with self.receiver.active():
            out = self.engine.generate(prompts, num_generations)
        self.ctx.metrics.add("example/generations", 1)
        flat = [list(p) for p in prompts for _ in range(num_generations)]
        return RolloutResult(flat, out.completion_ids, out.logprobs, self.receiver.version, model_id)

    def close(self):
        self.receiver.close()
        self.sender.close()


class InProcessRollout:
    def open_runtime(self, ctx, setup):
        return ExampleRuntime(ctx, setup)


class ExampleRollout:
    @hookimpl
    def mrl_rollout_register_stages(self):
        return [StagePlugin("example-rollout", InProcessRollout, "the transformers engine in the trainer process")]


plugin = ExampleRollout()
