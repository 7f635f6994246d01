"""Attention metadata of one step in the flattened-token layout (fields of ../shared/DESIGN.md).

Shapes (``num_tokens`` is the token dim, ``num_reqs`` the request dim):

===================== ======= ===========================
field                 dtype   shape
===================== ======= ===========================
query_start_loc       int32   [num_reqs + 1]
seq_lens              int32   [num_reqs]
num_computed_tokens   int32   [num_reqs]
block_table           int32   [num_reqs, max_blocks]
slot_mapping          int64   [num_tokens]  (-1 = padding token, writes nothing)
max_query_len         int     host int
max_seq_len           int     host int
===================== ======= ===========================

Request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``; they are the last
``query_len`` positions of its sequence of ``seq_lens[i]`` tokens, so
``num_computed_tokens[i] == seq_lens[i] - query_len``. Tokens past ``query_start_loc[-1]`` are
padding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dbo_compile.errors import MetadataError

#: Which dim of each tensor field is indexed by what; read by the backend to know which graph
#: inputs are token-indexed (sliced) and which are request-indexed (re-built per ubatch).
FIELD_LAYOUT: dict[str, str] = {
    "query_start_loc": "request",
    "seq_lens": "request",
    "num_computed_tokens": "request",
    "block_table": "request",
    "slot_mapping": "token",
}


def query_lens_from(query_start_loc: list[int]) -> list[int]:
    """Query lens (tokens per request) from host ``query_start_loc`` offsets ``[R+1]``."""
    return [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]


@dataclass
class AttentionMetadata:
    """Per-step attention metadata; see the module docstring for shapes and dtypes."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Rows of the token dim, padding included."""
        return int(self.slot_mapping.shape[0])

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in FIELD_LAYOUT}

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def host_fields(self) -> tuple[list[int], list[int], list[int]]:
        """``query_start_loc``, ``seq_lens`` and ``num_computed_tokens`` as host ints, read from
        the device in one copy (each device read is a host sync on CUDA)."""
        r = self.num_reqs
        fields = (self.query_start_loc, self.seq_lens, self.num_computed_tokens)
        if len({t.device for t in fields}) == 1 and len({t.dtype for t in fields}) == 1:
            flat = torch.cat([t.reshape(-1) for t in fields]).tolist()
            return flat[:r + 1], flat[r + 1:2 * r + 1], flat[2 * r + 1:]
        return tuple(t.tolist() for t in fields)  # type: ignore[return-value]

    def validate(self, host: tuple[list[int], list[int], list[int]] | None = None
                 ) -> AttentionMetadata:
        """Check dtypes, shapes and the relations between the fields.

        Args:
            host: ``(query_start_loc, seq_lens, num_computed_tokens)`` as host ints when the
                caller has them (no device read); default :meth:`host_fields` (one read).

        Raises:
            MetadataError: naming the field and the values that disagree.
        """
        expected = {
            "query_start_loc": torch.int32,
            "seq_lens": torch.int32,
            "num_computed_tokens": torch.int32,
            "block_table": torch.int32,
            "slot_mapping": torch.int64,
        }
        for name, dtype in expected.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise MetadataError(f"AttentionMetadata.{name} must be a tensor, got {type(t)}")
            if t.dtype != dtype:
                raise MetadataError(f"AttentionMetadata.{name} must be {dtype}, got {t.dtype}")
        r = self.num_reqs
        if self.query_start_loc.shape != (r + 1,):
            raise MetadataError(
                f"query_start_loc has shape {tuple(self.query_start_loc.shape)}, expected "
                f"[num_reqs + 1] = [{r + 1}] (num_reqs from seq_lens)"
            )
        for name in ("num_computed_tokens",):
            if getattr(self, name).shape != (r,):
                raise MetadataError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected [{r}]")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != r:
            raise MetadataError(
                f"block_table has shape {tuple(self.block_table.shape)}, expected [{r}, max_blocks]"
            )
        if self.slot_mapping.dim() != 1:
            raise MetadataError("slot_mapping must be 1-D [num_tokens]")
        host_qsl, host_seq, host_ctx = host if host is not None else self.host_fields()
        qsl = torch.tensor(host_qsl, dtype=torch.int64)
        seq = torch.tensor(host_seq, dtype=torch.int64)
        ctx = torch.tensor(host_ctx, dtype=torch.int64)
        qlens = qsl[1:] - qsl[:-1]
        if r and int(qsl[0]) != 0:
            raise MetadataError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
        if bool((qlens < 0).any()):
            raise MetadataError(f"query_start_loc must be non-decreasing, got {qsl.tolist()}")
        if int(qsl[-1]) > self.num_tokens:
            raise MetadataError(
                f"query_start_loc[-1]={int(qsl[-1])} exceeds num_tokens={self.num_tokens} "
                "(slot_mapping rows)"
            )
        if bool((seq < qlens).any()):
            raise MetadataError(
                f"seq_lens {seq.tolist()} shorter than the query lens {qlens.tolist()}"
            )
        if not torch.equal(ctx, seq - qlens):
            raise MetadataError(
                "num_computed_tokens must equal seq_lens - query_lens: got "
                f"{ctx.tolist()} vs {(seq - qlens).tolist()}"
            )
        if r and self.max_query_len < int(qlens.max()):
            raise MetadataError(f"max_query_len={self.max_query_len} < longest query {int(qlens.max())}")
        if r and self.max_seq_len < int(seq.max()):
            raise MetadataError(f"max_seq_len={self.max_seq_len} < longest sequence {int(seq.max())}")
        return self
