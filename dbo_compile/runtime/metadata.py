"""The attention-metadata schema, where users have imported it so far; it lives on the ground
floor, :mod:`dbo_compile.metadata`, since the compile stages read it too."""

from dbo_compile.metadata import (  # noqa: F401
    FIELD_DTYPE,
    FIELD_LAYOUT,
    AttentionMetadata,
    HostCounts,
    host_tensor,
    int_list,
    query_lens_from,
)

__all__ = ["FIELD_DTYPE", "FIELD_LAYOUT", "AttentionMetadata", "HostCounts", "host_tensor",
           "int_list", "query_lens_from"]
