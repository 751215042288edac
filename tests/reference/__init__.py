"""Reference decoding loops: compact re-implementations of the authors' research code, written
here from reading it (never copied), or of the paper's algorithm where the code is not public
(AdaDecode), on transformers' own modules (the model's decoder layers, final norm and LM head,
with transformers' ``DynamicCache``). The reference tests (``tests/test_reference_*.py``) run them
and selfspec's ``*_paper`` configurations on the same prompt and compare outputs and per-step
traces (docs/design/fidelity.md)."""
