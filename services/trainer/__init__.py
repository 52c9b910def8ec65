"""GRPO training with gradient routing.

`model` runs the engine's Llama-family model in training mode (full-sequence causal forward
with autograd), `adapters` adds the SVD-basis kept/quarantine adapters to its Linears, and
`routing` extracts hack directions and routes each rollout's gradient (Arm A: gradient mask
through the gate identity; Arm B: activation mask).
"""
