"""Generation backends for 01b: the target writes the response to a rendered prompt.

Both return, per prompt, `{"completion", "finish_reason", "num_prompt_tokens", "num_completion_tokens"}`
where `completion` is exactly the target's tokens as text, special tokens kept, ending with
`<|im_end|>` when finish_reason is "stop".
  OpenAIBackend  async `generate(prompt_text, max_new_tokens)` against an OpenAI-compatible server
                 (SGLang, vLLM) through `/v1/completions`; the caller runs many at once.
  HFBackend      batched `generate_batch(prompt_texts, max_new_tokens)` in-process with transformers
                 (the tiny world, tests).
"""
from __future__ import annotations

from common.chat_format import IM_END


class OpenAIBackend:
    """Raw completions from an OpenAI-compatible server, prompt rendered by us.

    Request fields, checked against SGLang `python/sglang/srt/entrypoints/openai/protocol.py`
    (CompletionRequest) and vLLM's CompletionRequest:
      skip_special_tokens=False          both: keep <think>, </think>, tool-call markers, <|im_end|>
      spaces_between_special_tokens=False  vLLM (default True would insert spaces around specials)
      no_stop_trim=True                  SGLang: keep the matched stop in the text
      include_stop_str_in_output=True    vLLM: same
      add_special_tokens=False           vLLM (default True may prepend BOS to our rendered prompt)
    Each server ignores the others' fields. Even so a server may trim the stop: both SGLang and vLLM
    cut a matched stop string / eos token from the text by default, and older versions lack the
    keep-stop fields. The model DID emit `<|im_end|>` (that is what "stop" on that string means), and
    the draft must learn to predict it, so when finish_reason is "stop" and the text lacks it we append it.
    """

    name = "openai"

    def __init__(self, server_url: str, model: str | None, api_key: str = "EMPTY", temperature: float = 0.0,
                 request_timeout: float = 600.0, max_retries: int = 3, seed: int | None = None,
                 special_tokens: dict[int, str] | None = None):
        from openai import AsyncOpenAI

        # The client retries connection errors, timeouts, 408/409/429 and 5xx with backoff.
        self.client = AsyncOpenAI(base_url=server_url, api_key=api_key, timeout=request_timeout,
                                  max_retries=max_retries)
        self.model, self.temperature, self.seed = model, temperature, seed
        self.special_tokens = special_tokens or {}

    async def resolve_model(self) -> str:
        """The served model name: the given one, else the server's only model (GET /v1/models)."""
        if self.model is None:
            models = [m.id async for m in self.client.models.list()]
            if len(models) != 1:
                raise ValueError(f"server serves {models}; pass --served-model-name")
            self.model = models[0]
        return self.model

    async def generate(self, prompt_text: str, max_new_tokens: int) -> dict:
        seed = {"seed": self.seed} if self.seed is not None else {}
        resp = await self.client.completions.create(
            model=self.model, prompt=prompt_text, max_tokens=max_new_tokens,
            temperature=self.temperature, stop=[IM_END], **seed,
            extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False,
                        "no_stop_trim": True, "include_stop_str_in_output": True,
                        "add_special_tokens": False})
        choice = resp.choices[0]
        text, finish = choice.text, choice.finish_reason
        if finish not in ("stop", "length"):
            raise ValueError(f"finish_reason {finish!r}")
        if finish == "stop":
            # SGLang reports what stopped it in `matched_stop` (a stop string or an eos token id).
            matched = getattr(choice, "matched_stop", None)
            stop_text = self.special_tokens.get(matched, IM_END) if isinstance(matched, int) else (matched or IM_END)
            if not text.endswith(stop_text):
                text += stop_text
        usage = resp.usage
        return {"completion": text, "finish_reason": finish,
                "num_prompt_tokens": usage.prompt_tokens if usage else None,
                "num_completion_tokens": usage.completion_tokens if usage else None}

    async def close(self) -> None:
        await self.client.close()


class HFBackend:
    """Left-padded batched generation with transformers (fp32 on CPU, bf16 on CUDA)."""

    name = "hf"

    def __init__(self, model_path, tokenizer, device: str = "cpu", temperature: float = 0.0, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.tok, self.device = torch, tokenizer, device
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
        self.temperature, self.seed = temperature, seed
        self.eos_id = tokenizer.convert_tokens_to_ids(IM_END)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

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
                temperature=self.temperature if sample else None, top_p=None, top_k=None,
                eos_token_id=self.eos_id, pad_token_id=self.pad_id)
        gen = out[:, width:].tolist()                                                  # [B, new]
        results = []
        for x, row, cap in zip(ids, gen, max_new_tokens):
            row = row[:cap]
            finish = "length"
            if self.eos_id in row:
                row, finish = row[:row.index(self.eos_id) + 1], "stop"
            results.append({"completion": self.tok.decode(row, skip_special_tokens=False),
                            "finish_reason": finish, "num_prompt_tokens": len(x),
                            "num_completion_tokens": len(row)})
        return results
