"""The engine catalogue: what a GPU process runs its batches on.

`catalogue` is the one list of engines (name, module, class, extra, settings class, mode); `sim` is
the default, a CPU cost model with an LRU prefix-block cache (`continuous` models continuous
batching); `hf`, `vllm`, `trtllm` and `openai` are real engines imported lazily with their extras;
`options` declares each engine's settings (config/engines.py reads them from the TOML file). Run
inside a GPU process (`gpu/`); engines never see a ring.
"""
