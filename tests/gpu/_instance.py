"""One vLLM instance on a GPU (run as a script by test_engine.py): generate, report JSON.

argv: MODEL PROMPTS_JSON OUT_JSON MODE (none | ours) REPEAT (0 | 1) [preempt]

``preempt``: every prompt at once into a KV cache too small for all of them to decode
(``PREEMPT_BLOCKS`` blocks, ``PREEMPT_TOKENS`` output tokens each), so vLLM preempts
running requests; vLLM's preemption counter goes into the report.
"""

import json
import os
import sys
import threading

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

PREEMPT_BLOCKS, PREEMPT_TOKENS = 150, 320

model, prompts_path, out_path, mode, repeat = sys.argv[1:6]
preempt = sys.argv[6:7] == ["preempt"]
kw = dict(model=model, enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=8192,
          skip_tokenizer_init=True, dtype="bfloat16", disable_log_stats=False, seed=0)
if mode == "ours":
    kw["kv_transfer_config"] = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
if preempt:  # vLLM checks one max_model_len request fits: 150 blocks of 16 tokens do
    kw.update(num_gpu_blocks_override=PREEMPT_BLOCKS, max_model_len=2048)
llm = LLM(**kw)
sp = SamplingParams(max_tokens=PREEMPT_TOKENS if preempt else 12, temperature=0.0,
                    ignore_eos=True, detokenize=False)
runs = []
prompts = json.load(open(prompts_path))
if preempt:
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sp, use_tqdm=False)
    runs = [{"n": len(o.prompt_token_ids), "cached": o.num_cached_tokens,
             "tokens": list(o.outputs[0].token_ids)} for o in outs]
else:
    for ids in prompts:
        for _ in range(2 if repeat == "1" else 1):
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            runs.append({"n": len(ids), "cached": out.num_cached_tokens,
                         "tokens": list(out.outputs[0].token_ids)})
preemptions = sum(getattr(m, "value", 0) for m in llm.get_metrics()
                  if m.name == "vllm:num_preemptions")
if mode == "ours":
    import time
    time.sleep(5)  # saves are asynchronous: let them land before the engine goes away
json.dump({"runs": runs, "preemptions": preemptions}, open(out_path, "w"))
th = threading.Thread(target=lambda: llm.llm_engine.engine_core.shutdown(), daemon=True)
th.start()
th.join(30)
sys.stdout.flush()
os._exit(0)
