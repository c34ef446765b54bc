"""Data: seeded synthetic token streams (default) or a flat tokenized file read through numpy.memmap."""

from __future__ import annotations

import numpy as np
import torch


class SyntheticData:
    """Sequences from a fixed random sparse bigram chain (each token has 4 likely successors), so the
    loss has something to learn and falls well below ln(V). Deterministic in (seed, step, rank)."""

    def __init__(self, cfg: dict, rank: int):
        self.V, self.S, self.B = cfg["vocab_size"], cfg["seq_len"], cfg["micro_batch_size"]
        self.seed, self.rank = cfg["seed"], rank
        g = np.random.default_rng(cfg["seed"])
        self.succ = g.integers(0, self.V, size=(self.V, 4))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = np.random.default_rng([self.seed, step, self.rank])
        toks = np.empty((self.B, self.S + 1), dtype=np.int64)
        toks[:, 0] = g.integers(0, self.V, size=self.B)
        choice = g.integers(0, 4, size=(self.B, self.S))
        noise = g.random((self.B, self.S)) < 0.05
        rand = g.integers(0, self.V, size=(self.B, self.S))
        for t in range(self.S):
            nxt = self.succ[toks[:, t], choice[:, t]]
            toks[:, t + 1] = np.where(noise[:, t], rand[:, t], nxt)
        x = torch.from_numpy(toks)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class MemmapData:
    """Random windows of seq_len+1 tokens from a flat token file (e.g. a GPT-2-tokenised .bin)."""

    def __init__(self, cfg: dict, rank: int):
        from trainer.config import ConfigError

        try:
            self.tokens = np.memmap(cfg["data_path"], dtype=np.dtype(cfg["data_dtype"]), mode="r")
        except (OSError, ValueError) as err:
            raise ConfigError("data_path", f"cannot read {cfg['data_path']}: {err}") from None
        self.S, self.B, self.V = cfg["seq_len"], cfg["micro_batch_size"], cfg["vocab_size"]
        if len(self.tokens) <= self.S + 1:
            raise ConfigError("data_path", f"{cfg['data_path']} holds {len(self.tokens)} tokens, fewer than seq_len+2")
        self.seed, self.rank = cfg["seed"], rank

    def batch(self, step: int):
        g = np.random.default_rng([self.seed, step, self.rank])
        starts = g.integers(0, len(self.tokens) - self.S - 1, size=self.B)
        toks = np.stack([np.asarray(self.tokens[s:s + self.S + 1], dtype=np.int64) for s in starts])
        if toks.max() >= self.V:
            from trainer.config import ConfigError

            raise ConfigError("vocab_size", f"token id {int(toks.max())} in {self.tokens.filename} >= vocab_size")
        x = torch.from_numpy(toks)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def make_data(cfg: dict, rank: int):
    return MemmapData(cfg, rank) if cfg["data"] == "memmap" else SyntheticData(cfg, rank)
