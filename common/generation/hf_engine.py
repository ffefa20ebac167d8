"""The in-process generation engine: batched `generate_batch(prompt_texts, max_new_tokens)` with
transformers (the tiny world, tests, SmolLM2 on CPU); same result dicts as
common/generation/server_pool.ServerPool, plus `completion_ids` (the ids the target emitted, end-of-turn
id included when it stopped)."""
from __future__ import annotations


class HFEngine:
    """Left-padded batched generation with transformers (fp32 on CPU, bf16 on CUDA).

    `stop_ids`: the ids that end a turn (common/text/target_format.TargetFormat.stop_ids); the first one
    also pads when the tokenizer has no pad token. `generator` names what decides the greedy answers
    (engine and dtype), for the response cache's identity.
    """

    name = "hf"

    def __init__(self, model_path, tokenizer, stop_ids, device: str = "cpu", temperature: float = 0.0,
                 seed: int = 0, top_p: float = 1.0):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.tok, self.device = torch, tokenizer, device
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.generator = hf_generator(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
        self.temperature, self.seed, self.top_p = temperature, seed, top_p
        self.stop_ids = [int(i) for i in stop_ids]
        assert self.stop_ids, "HFEngine needs at least one stop id"
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def generate_batch(self, prompt_texts: list[str], max_new_tokens: list[int]) -> list[dict]:
        torch = self.torch
        ids = self.tok(prompt_texts, add_special_tokens=False)["input_ids"]
        width = max(len(x) for x in ids)
        # Left padding: every prompt ends at the same column, so generated tokens line up.
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)  # [B, T]
        attention = torch.zeros((len(ids), width), dtype=torch.long)                # [B, T]
        for i, x in enumerate(ids):
            input_ids[i, width - len(x):] = torch.tensor(x)
            attention[i, width - len(x):] = 1
        sample = self.temperature > 0
        if sample:
            torch.manual_seed(self.seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                max_new_tokens=max(max_new_tokens), do_sample=sample,
                temperature=self.temperature if sample else None, top_p=self.top_p if sample else None, top_k=None,
                eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        gen = out[:, width:].tolist()                                                  # [B, new]
        stops = set(self.stop_ids)
        results = []
        for x, row, cap in zip(ids, gen, max_new_tokens):
            row = row[:cap]
            finish = "length"
            end = next((k for k, t in enumerate(row) if t in stops), None)
            if end is not None:  # the turn ended: keep the stop id (the draft learns to predict it)
                row, finish = row[:end + 1], "stop"
            results.append({"completion": self.tok.decode(row, skip_special_tokens=False),
                            "completion_ids": row, "finish_reason": finish, "num_prompt_tokens": len(x),
                            "num_completion_tokens": len(row)})
        return results


def hf_generator(device: str) -> str:
    """What decides the hf engine's greedy answers besides the model: the dtype its device runs in."""
    return "hf-float32" if device == "cpu" else "hf-bfloat16"
