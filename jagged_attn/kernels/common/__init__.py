"""What every kernel family shares: the owner modules' index math wrapped for Triton and Gluon
(``layout``), the ragged work list (``schedule``), persistent launches (``persistent``), derived
tensors kept across calls (``reuse``), TMA descriptors (``tma``), e4m3 / bf16 rounding (``fp8``) and
CPU-interpreter support (``interpreter``)."""
