"""dspark_kernels inside other engines: ``integrations.vllm`` (a vLLM general plugin and proposer) and
``integrations.flashinfer`` (FlashInfer's ``chain_speculative_sampling`` signature on ``dk.verify_chain``).

Nothing here is imported by ``import dspark_kernels``; each submodule imports its engine only when it needs it.
"""
