"""The transfer spec refuses values the engine would fail on later, saying the limit."""

from __future__ import annotations

import pytest

from pdflow.spec import TransferSpec
from pdflow.spec.load import compose_spec


@pytest.mark.parametrize(("field", "value", "message"), [
    ("descriptor_batch", 1025, "at most 1024"),
    ("staging_mib", 2048, "under 2 GiB"),
    ("staging_mib", 0, "staging_mib"),
    ("retries", -1, "retries"),
    ("timeout_s", 0, "timeout_s"),
])
def test_out_of_range_values_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        TransferSpec(protocol="tcp", **{field: value})


def test_rdma_may_batch_more_and_the_shipped_configs_compose():
    assert TransferSpec(protocol="rdma", descriptor_batch=4096).descriptor_batch == 4096
    for choice in ("mooncake_tcp", "mooncake_rdma"):
        assert compose_spec([f"transfer={choice}"]).transfer.descriptor_batch <= 1024
