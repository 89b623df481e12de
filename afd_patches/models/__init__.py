"""AFD model variants, registered lazily with vLLM as ``AFD<Arch>`` architectures.

Each variant subclasses a vLLM model class and delegates to it; the role comes
from ``vllm_config.additional_config["afd"]``:

- attention role: vLLM's model, with each decoder layer's MLP/MoE module swapped
  for a parameter-free proxy that exchanges hidden states with the FFN role;
  weight loading skips the MLP/expert weights;
- FFN role: only the per-layer MLP/MoE modules (no attention, no KV cache), and
  only their weights.

Nothing here is imported until vLLM loads a model of one of these architectures
(the manifest registers ``module:Class`` strings).
"""
