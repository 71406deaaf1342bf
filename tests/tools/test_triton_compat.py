"""The AOT tooling's reads of Triton internals are tied to one Triton series and say so."""

from __future__ import annotations

import pytest

from lowbit_attn.tools import triton_compat


@pytest.mark.aot  # (skipped with the reason on a Triton outside WRITTEN_FOR)
def test_the_installed_triton_is_the_one_the_internals_were_written_for():
    triton_compat.check_version()


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.6.0+git1a2b3c", "3.8.0", "3.9.0"])
def test_releases_of_the_series_are_accepted(version):
    triton_compat.check_version(version)


@pytest.mark.parametrize("version", ["3.5.1", "3.7.0", "4.0.0", "3.60.0"])
def test_other_releases_are_refused_by_name(version):
    with pytest.raises(RuntimeError, match=rf"internals of Triton 3\.6\.x, 3\.8\.x, 3\.9\.x, "
                                           rf"found Triton {version}"):
        triton_compat.check_version(version)


def test_pointer_types_are_tritons_names():
    import torch

    assert triton_compat.pointer_type(torch.float16) == "*fp16"
    assert triton_compat.pointer_type(torch.int8) == "*i8"
    assert triton_compat.pointer_type(torch.float8_e4m3fn) == "*fp8e4nv"
