"""How much greedy output survives rounding the activations of every linear layer: the
check behind README's "int8 activations are not sound for this model" (CPU kernels).

Runs a float32 transformers model (the safetensors copy of the bundled GGUF that
`scripts/setup_peers.sh` writes, or any HF directory) over 16 chats, 32 greedy tokens
each, once exactly and once per rounding mode, and prints how many answers stay equal and
how far the rounded run's logprobs of its own tokens are from the exact model's:

- bf16: activations and weights rounded to bf16 (what bf16 products do);
- int8: each 32-value block of activations scaled to integers in [-127, 127] (llama.cpp's
  Q8 activations), weights exact;
- int14: the same to [-8191, 8191] (the VNNI kernel's two int8 halves).

    python scripts/activation_rounding.py [HF_DIR] [MODES...]

The lm_head is left exact (its own kernels decide its numerics).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers greater than 100.", "Translate 'good morning' into Spanish and German.",
         "def fib(n):\n    # complete this Python function", "Explain in one sentence why the sky is blue.",
         "Quel est le plus long fleuve du monde ?", "Give me a JSON object with keys name and age.",
         "Summarise the plot of Hamlet in two sentences.", "What is 17 times 23?",
         "Name four planets of the solar system.", "Write a Python function that reverses a string.",
         "Why do cats purr?", "Describe a rainbow to a child.", "What does HTTP stand for?",
         "Give three tips for learning a language."]
NUM_TOKENS = 32


def block_rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x with each 32-value block of its last dim scaled to integers in [-levels, levels]."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    top = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return (torch.round(blocks / top * levels) * (top / levels)).reshape(x.shape)


def main(path: str, modes: list[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head = model.get_output_embeddings()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
               for c in CHATS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    mode = ["exact"]
    exact_forward = torch.nn.Linear.forward

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if mode[0] == "exact" or self is head:
            return exact_forward(self, x)
        if mode[0] == "bf16":
            return F.linear(x.bfloat16().float(), self.weight.bfloat16().float(), self.bias)
        return F.linear(block_rounded(x, {"int8": 127, "int14": 8191}[mode[0]]), self.weight, self.bias)

    torch.nn.Linear.forward = forward

    def greedy() -> list[list[int]]:
        with torch.no_grad():
            return [model.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                   pad_token_id=tok.eos_token_id)[0, len(p):].tolist() for p in prompts]

    def logprobs(answers: list[list[int]]) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for p, t in zip(prompts, answers):
                logits = model(torch.tensor([p + t])).logits[0].double()
                out.append(torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(1, torch.tensor(t)[:, None])[:, 0])
        return out

    reference = greedy()
    for name in modes:
        mode[0] = name
        answers = greedy()
        rounded = logprobs(answers)
        mode[0] = "exact"
        exact = logprobs(answers)
        equal = sum(a == b for a, b in zip(reference, answers))
        worst = max((a - b).abs().max().item() for a, b in zip(rounded, exact))
        print(f"{name}: {equal} of {len(prompts)} answers equal; logprobs of its tokens off by up to {worst:.3f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".peers/smollm2-hf", sys.argv[2:] or ["bf16", "int8", "int14"])
