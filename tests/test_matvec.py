"""hispec.matvec: the few-row fp32 product over column panels, its build, and its place among hispec.packed's
kernels."""

from __future__ import annotations

import pytest
import torch

from hispec import matvec, packed

needs = pytest.mark.skipif(not matvec.available(), reason="no AVX2 + FMA x86 CPU or no C compiler here")


@needs
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 49])
@pytest.mark.parametrize("k,n", [(1, 1), (7, 5), (16, 8), (19, 13), (576, 960), (64, 8200), (33, 16391)])
def test_the_product_is_x_times_w_transposed_and_a_row_the_same_alone_or_among_others(k, n, rows):
    g = torch.Generator().manual_seed(k * n)
    x, w, b = torch.randn(1, rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    ref = (x.double() @ w.double().t()).float()
    copy = matvec.panels(w)
    y = matvec.matvec(x, copy)
    assert y.shape == (1, rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert torch.equal(matvec.matvec(x[0], copy, b), y[0] + b)  # the bias added after the chain, as torch adds it
    # what makes a verification pass's products its rows' one-position products (any number of rows)
    assert all(torch.equal(y[:, t], matvec.matvec(x[:, t], copy)) for t in range(rows))


def test_the_panel_copy_is_w_transposed_in_blocks_of_8_columns():
    w = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)  # 20 outputs: two blocks of 8, one of 4
    wt = w.t()
    expect = torch.cat([wt[:, :8].reshape(-1), wt[:, 8:16].reshape(-1), wt[:, 16:].reshape(-1)])
    assert torch.equal(matvec.panels(w), expect) and matvec.panels(w).is_contiguous()


@needs
def test_each_column_is_summed_alike_whatever_the_columns_beside_it():
    # what makes a merged product (hispec.merged) the separate products bit for bit
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 576, generator=g) for n in (576, 192, 200, 8200)]
    for rows in (1, 4, 9):
        x = torch.randn(1, rows, 576, generator=g)
        whole = matvec.matvec(x, matvec.panels(torch.cat(parts)))
        assert torch.equal(whole, torch.cat([matvec.matvec(x, matvec.panels(p)) for p in parts], -1))


@needs
def test_bad_inputs_are_refused_before_the_call():
    copy = matvec.panels(torch.randn(4, 8))
    for x, c in [(torch.randn(2, 7), copy), (torch.randn(1, 8).double(), copy), (torch.randn(1, 8), copy.view(8, 4)),
                 (torch.randn(1, 0), copy)]:
        with pytest.raises(ValueError, match="fp32 rows"):
            matvec.matvec(x, c)
    with pytest.raises(ValueError, match="bias"):
        matvec.matvec(torch.randn(1, 8), copy, torch.randn(5))


def test_it_builds_into_the_cache_folder_and_is_unavailable_where_it_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matvec, "_lib", None)
    if matvec._supported() and (matvec.shutil.which("cc") or matvec.shutil.which("gcc")):
        assert matvec.available() and matvec.library_path().is_file()
        assert matvec.library_path().parent == tmp_path / "kernels"
        assert [p.name for p in (tmp_path / "kernels").iterdir()] == [matvec.library_path().name]  # no leftovers
    monkeypatch.setattr(matvec, "_lib", None)
    monkeypatch.setattr(matvec, "_supported", lambda: False)  # e.g. an ARM or pre-AVX2 CPU
    assert not matvec.available()
    lin = packed.PackedLinear.wrap(torch.nn.Linear(8, 4))
    lin.set_kernels(packed.STREAMED, packed.PACKED)
    assert lin.one == packed.STOCK  # not here: the stock product
    monkeypatch.setattr(matvec, "_lib", None)
    monkeypatch.setattr(matvec, "_supported", lambda: True)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HISPEC_CACHE_DIR", str(tmp_path / "fresh"))
    assert not matvec.available()
    monkeypatch.setattr(matvec, "_lib", None)


@needs
def test_a_packed_linear_streams_its_rows():
    torch.manual_seed(0)
    lin = packed.PackedLinear.wrap(torch.nn.Linear(48, 80))
    lin.set_kernels(packed.STREAMED, packed.STREAMED)
    one, four, many = torch.randn(1, 1, 48), torch.randn(1, 4, 48), torch.randn(2, 40, 48)
    with torch.no_grad():
        assert lin._kernel(one) is packed.STREAMED and lin._kernel(four) is packed.STREAMED
        assert lin._kernel(many) is packed.PACKED  # a prompt's rows past matvec.MAX_ROWS: oneDNN's GEMM
        for x in (one, four, many):
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert torch.equal(lin(one), matvec.matvec(one, matvec.panels(lin.weight), lin.bias))
        assert torch.equal(lin(four)[:, 2:3], lin(four[:, 2:3]))
        assert set(lin._copies) == {packed.STREAMED, packed.PACKED}
        lin.set_kernels(packed.STREAMED, packed.TRANSPOSED)
        assert set(lin._copies) == {packed.STREAMED}  # a copy no kernel reads any more is dropped
        with torch.enable_grad():
            lin.weight.requires_grad_(True)
            assert lin._kernel(one) is packed.STOCK  # autograd on the weight: the stock product
