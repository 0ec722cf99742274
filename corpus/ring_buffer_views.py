"""A replay/ring buffer written through slices, index tensors and strided views, in place, with strides, offsets and data pointers checked."""
import torch

torch.manual_seed(0)


def r(t):
    return [round(v, 4) for v in t.flatten().tolist()]


n, d = 6, 4
buf = torch.zeros(n, d)
counts = torch.zeros(n, dtype=torch.long)
base_ptr = buf.data_ptr()
for step in range(9):
    x = torch.randn(d)
    buf[step % n] = x
    idx = torch.tensor([(step * 2) % n, (step * 2 + 3) % n])
    rows = torch.full((2, d), float(step))
    buf[idx] = rows
    dup = torch.tensor([step % n, step % n, (step + 1) % n])
    counts.index_put_((dup,), torch.ones(3, dtype=torch.long), accumulate=True)
    buf.index_put_((dup,), torch.ones(3, d), accumulate=True)
    print(step, "counts", counts.tolist(), "sum", round(buf.sum().item(), 4), buf.data_ptr() == base_ptr)
print("buf", r(buf))

# rolling windows two ways
win = torch.arange(8.0)
win2 = win.clone()
for step in range(5):
    win = torch.roll(win, -1)
    win[-1] = 100 + step
    win2[:-1] = win2[1:].clone()
    win2[-1] = 100 + step
    print(step, "roll", win.tolist(), "shift", win2.tolist(), torch.equal(win, win2))

# strided views written in place
for step in range(4):
    m = torch.arange(24.0).reshape(4, 6)
    ev = m[::2]
    ev.mul_(2)
    print(step, "ev", ev.stride(), ev.storage_offset(), ev.is_contiguous(), ev.data_ptr() == m.data_ptr())
    col = m[:, 1::2]
    col.add_(step)
    print(step, "col", col.stride(), col.storage_offset(), col.is_contiguous())
    mt = m.t()
    mt[0].fill_(-1)
    print(step, "t", mt.stride(), mt.is_contiguous(), mt[0].storage_offset())
    nr = m.narrow(1, 2, 3)
    nr.zero_()
    print(step, "narrow", nr.stride(), nr.storage_offset(), nr.data_ptr() - m.data_ptr())
    dg = m[:, :4].diagonal()
    dg.copy_(torch.tensor(7.0 + step).expand(4))
    print(step, "diag", dg.stride(), dg.storage_offset())
    row = m[3]
    uf = row.unfold(0, 3, 3)
    uf.add_(0.5)
    print(step, "unfold", tuple(uf.shape), uf.stride(), uf.storage_offset())
    ast = torch.as_strided(m, (2, 2), (7, 1), 1)
    ast.mul_(-1)
    print(step, "as_strided", ast.stride(), ast.storage_offset(), r(ast))
    bc = m[1:3, 4:]
    bc.copy_(torch.tensor([[10.0, 20.0]]))
    print(step, "m", r(m))

# expand + clone, in-place view ops
for step in range(3):
    v = torch.arange(3.0) + step
    e = v.unsqueeze(0).expand(4, 3)
    print(step, "expand", e.stride(), e.is_contiguous(), e.data_ptr() == v.data_ptr())
    c = e.clone()
    c[1].add_(10)
    print(step, "clone", c.stride(), r(c), r(v))
    y = torch.arange(6.0).reshape(2, 3) * (step + 1)
    yv = y[:]
    yv.unsqueeze_(0)
    print(step, "unsqueeze_", tuple(yv.shape), yv.stride(), tuple(y.shape))
    yv.squeeze_(0)
    yv.t_()
    print(step, "t_", tuple(yv.shape), yv.stride(), yv.is_contiguous())
    yv.mul_(2)
    print(step, "y", r(y))
    z = torch.arange(24.0).reshape(2, 3, 4)
    z.transpose_(0, 2)
    print(step, "transpose_", tuple(z.shape), z.stride(), z.is_contiguous())
    try:
        z.view(-1)
        print(step, "view ok")
    except RuntimeError as err:
        print(step, "view", type(err).__name__)
    rz = z.reshape(-1)
    print(step, "reshape", rz.stride(), rz.data_ptr() == z.data_ptr(), r(rz[:6]))
    zz = z.contiguous()
    vz = zz.view(4, 6)
    vz[0, 0] = -step
    print(step, "view after contiguous", vz.stride(), zz[0, 0, 0].item(), z[0, 0, 0].item())
    zt = torch.arange(6.0).reshape(2, 3).t()
    zr = zt.reshape(6)
    zr[0] = 99
    print(step, "reshape copy", zt[0, 0].item(), zr.is_contiguous())
