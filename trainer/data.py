"""Data: seeded synthetic token streams (default) or a flat tokenized file read through numpy.memmap.

Every step has a *global batch* of ``replicas * microbatches * micro_batch_size`` sequences, where
``replicas = dp * ep`` is the number of data-parallel model replicas (pipeline stages of one replica
share its data). Sequence ``g`` of step ``s`` is a function of ``(seed, s, g)`` alone, and replica
``r`` reads sequences ``[r * M * B, (r + 1) * M * B)``, micro-batch ``i`` being rows ``[i*B, (i+1)*B)``
of what :meth:`batch` returns. So any layout of the same global batch (1 process x 8 micro-batches,
4 replicas x 2, a pipeline with 8) trains on exactly the same tokens, and losses can be compared.
"""

from __future__ import annotations

import numpy as np
import torch


def _rows(cfg: dict, rank: int) -> range:
    """Global sequence indices of data-parallel replica ``rank`` in every step."""
    n = cfg["micro_batch_size"] * cfg.get("microbatches", 1)
    return range(rank * n, (rank + 1) * n)


class SyntheticData:
    """Sequences from a fixed random sparse bigram chain (each token has 4 likely successors), so the
    loss has something to learn and falls well below ln(V). Sequence g of step s is deterministic in
    (seed, s, g); :meth:`batch` returns this replica's ``microbatches * micro_batch_size`` rows."""

    def __init__(self, cfg: dict, rank: int):
        self.V, self.S = cfg["vocab_size"], cfg["seq_len"]
        self.seed, self.rank = cfg["seed"], rank
        self.rows = _rows(cfg, rank)
        g = np.random.default_rng(cfg["seed"])
        self.succ = g.integers(0, self.V, size=(self.V, 4))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.rows)
        toks = np.empty((n, self.S + 1), dtype=np.int64)
        choice = np.empty((n, self.S), dtype=np.int64)
        noise = np.empty((n, self.S), dtype=bool)
        rand = np.empty((n, self.S), dtype=np.int64)
        for i, row in enumerate(self.rows):
            g = np.random.default_rng([self.seed, step, row])
            toks[i, 0] = g.integers(0, self.V)
            choice[i] = g.integers(0, 4, size=self.S)
            noise[i] = g.random(self.S) < 0.05
            rand[i] = g.integers(0, self.V, size=self.S)
        for t in range(self.S):
            nxt = self.succ[toks[:, t], choice[:, t]]
            toks[:, t + 1] = np.where(noise[:, t], rand[:, t], nxt)
        x = torch.from_numpy(toks)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class MemmapData:
    """Random windows of seq_len+1 tokens from a flat token file (e.g. a GPT-2-tokenised .bin)."""

    def __init__(self, cfg: dict, rank: int):
        from moespec.config import ConfigError

        try:
            self.tokens = np.memmap(cfg["data_path"], dtype=np.dtype(cfg["data_dtype"]), mode="r")
        except (OSError, ValueError) as err:
            raise ConfigError("data_path", f"cannot read {cfg['data_path']}: {err}") from None
        self.S, self.V = cfg["seq_len"], cfg["vocab_size"]
        if len(self.tokens) <= self.S + 1:
            raise ConfigError("data_path", f"{cfg['data_path']} holds {len(self.tokens)} tokens, fewer than seq_len+2")
        self.seed, self.rank = cfg["seed"], rank
        self.rows = _rows(cfg, rank)

    def batch(self, step: int):
        hi = len(self.tokens) - self.S - 1
        starts = [np.random.default_rng([self.seed, step, row]).integers(0, hi) for row in self.rows]
        toks = np.stack([np.asarray(self.tokens[s:s + self.S + 1], dtype=np.int64) for s in starts])
        if toks.max() >= self.V:
            from moespec.config import ConfigError

            raise ConfigError("vocab_size", f"token id {int(toks.max())} in {self.tokens.filename} >= vocab_size")
        x = torch.from_numpy(toks)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def make_data(cfg: dict, rank: int):
    """The data of data-parallel replica ``rank`` (``dp_rank * ep + ep_rank``; not the global rank
    under pipeline parallelism, whose stages of one replica share the data)."""
    return MemmapData(cfg, rank) if cfg["data"] == "memmap" else SyntheticData(cfg, rank)
