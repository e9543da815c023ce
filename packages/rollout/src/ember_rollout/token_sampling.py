"""Temperature, top-k and top-p filtering, seeded sampling, and what a token's log-prob means."""

from __future__ import annotations

import torch


def tempered_log_probs(logits_BV: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """Log-probs [B, V] of the full vocabulary at the temperature: log softmax(logits / T), fp32.

    What a sample's `rollout_log_probs` mean, whatever top-k and top-p the engine samples with:
    the trainer's `PolicyHead(temperature)` computes the same, and SGLang 0.5.23 returns the same
    (`srt/layers/sampler.py`: the log of the tempered softmax, taken before its top-k/top-p
    filter).

    Args:
        logits_BV: Raw logits, any float dtype.
        temperature: One value, or one per row ([B]).
    """
    logits = logits_BV.float()
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    scaled = logits / temperature.reshape(-1, 1) if temperature.dim() else logits / temperature
    return torch.log_softmax(scaled, dim=-1)


def filter_log_probs(
    log_probs_BV: torch.Tensor,
    top_k: torch.Tensor | int = -1,
    top_p: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """The distribution sampled from [B, V]: tempered log-probs filtered and renormalised.

    Top-k keeps the k most likely tokens (ties broken by token id); top-p keeps a token while
    the probability mass of the tokens ranked before it is below top_p, computed on the
    unfiltered distribution as SGLang does, so the most likely token is always kept. A token is
    kept only if both filters keep it; the kept tokens are renormalised and every other token
    gets -inf.

    Args:
        log_probs_BV: `tempered_log_probs` of the rows.
        top_k: -1 (or any value < 1) for off; one value, or one per row.
        top_p: 1.0 for off; one value, or one per row.
    """
    log_probs = log_probs_BV
    batch, vocab = log_probs.shape
    top_k = torch.as_tensor(top_k, device=log_probs.device).expand(batch)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=log_probs.device).expand(batch)
    k = torch.where(top_k >= 1, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k >= vocab).all()) and bool((top_p >= 1).all()):
        return log_probs

    # Stable sort: equal logits keep token-id order, so the kept set is deterministic.
    sorted_lp, order = torch.sort(log_probs, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=log_probs.device)
    keep_sorted = ranks.unsqueeze(0) < k.unsqueeze(1)
    mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
    keep_sorted &= (mass_before < top_p.unsqueeze(1)) | (ranks == 0).unsqueeze(0)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return torch.log_softmax(log_probs.masked_fill(~keep, float("-inf")), dim=-1)


def filtered_log_probs(
    logits_BV: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = -1,
    top_p: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Log-probs [B, V] of the distribution sampled from: scaled, filtered, renormalised
    (`filter_log_probs` of `tempered_log_probs`). The engine samples from these; the log-probs
    it reports are the tempered ones."""
    return filter_log_probs(tempered_log_probs(logits_BV, temperature), top_k, top_p)


def sample_tokens(log_probs_BV: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row from exp(log_probs), row b using `generators[b]`.

    Inverse-CDF sampling with one uniform draw per row: each row's draw depends only on its own
    generator, so a request samples the same tokens whatever batch it runs in.

    Returns:
        [B] int64 token ids; a token with zero probability is never drawn.
    """
    if len(generators) != log_probs_BV.shape[0]:
        raise ValueError(
            f"sample_tokens: {len(generators)} generators for {log_probs_BV.shape[0]} rows"
        )
    probs = log_probs_BV.float().exp()
    cdf = torch.cumsum(probs, dim=-1)
    uniform = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators])
    targets = uniform.to(probs.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[1] - 1)
