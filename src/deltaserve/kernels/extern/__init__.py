"""Adapters of kernels from other libraries: fla-core's KDA (`fla_kda`), torch's flash varlen
attention (`flash_prefill`), FlashInfer's MLA decode (`flashinfer_mla`) and `triton_kernels`'
MXFP4 MoE (`ogs_moe`). Each is optional: where its library does not import, or its switch is off,
the backend runs our own kernel or the reference op instead."""
