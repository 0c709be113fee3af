"""LoRA linear layers in Triton: :mod:`.linear` (one projection), :mod:`.shared_input` (projections of one input),
built from :mod:`.rank_ops` (the rank-r passes) and :mod:`.gemm` (the GEMM with the rank-r epilogue);
:mod:`.dispatch` picks the engine per call, :mod:`.chained` is the chained-cuBLAS baseline, :mod:`.graphs` captures
one layer's forward and backward as CUDA graphs."""
