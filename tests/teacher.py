"""Teacher forcing per weight version, for GRPO runs through real TRL trainers.

:class:`VersionRecorder` hooks an enabled trainer's rollout (``trainer.vllm_generation``, the plugin's
``adapters.trl_generation.MrlGeneration``): every version it publishes is snapshotted (the presets are a few MB),
every batch it returns is recorded with the version it is tagged with. :meth:`VersionRecorder.max_error` then
scores each recorded completion by teacher forcing under its version's weights and returns the largest difference
to the engine's logprobs.
"""

from __future__ import annotations

from typing import Any


def teacher_forced(model: Any, prompt: list[int], completion: list[int], temperature: float = 1.0) -> Any:
    """``log_softmax(logits / temperature)`` of each completion token, one forward pass (fp32)."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(completion).unsqueeze(1))
    return picked.squeeze(1)


class VersionRecorder:
    """Records the published versions' weights and the batches generated under them (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        gen = trainer.vllm_generation
        self.model = trainer.accelerator.unwrap_model(trainer.model)
        self.snapshots: dict[int, dict[str, Any]] = {0: self._weights()}
        self.batches: list[tuple[list[list[int]], list[list[int]], list[list[float]], int]] = []
        sync = gen.sync_weights

        def sync_weights() -> None:
            sync()
            self.snapshots[int(gen.version)] = self._weights()

        gen.sync_weights = sync_weights
        runtime = gen.runtime  # every generation: a batch's first turn, follow-up turns, turns of a batch run ahead
        for name in ("generate", "generate_turn"):
            method = getattr(runtime, name, None)
            if method is not None:
                setattr(runtime, name, self._recording(method))

    def _recording(self, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            copied = [[list(x) for x in part] for part in (result.prompt_ids, result.completion_ids, result.logprobs)]
            self.batches.append((*copied, result.weight_version))
            return result

        return call

    def _weights(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def versions(self) -> list[int]:
        return [b[3] for b in self.batches]

    def max_error(self, temperature: float = 1.0) -> float:
        """Largest |engine logprob - teacher-forced logprob under the tagged version| over every recorded token."""
        import torch

        from mrl_plugins.weight_sync.sources import inference_copy

        scorer = inference_copy(self.model)  # the class's own forward (TRL's fused head closes over the trainer's)
        err = 0.0
        for prompts, completions, logprobs, version in self.batches:
            scorer.load_state_dict(self.snapshots[version])
            for p, c, lp in zip(prompts, completions, logprobs, strict=True):
                if c:
                    tf = teacher_forced(scorer, p, c, temperature)
                    err = max(err, (tf - torch.tensor(lp[: len(c)])).abs().max().item())
        return err
