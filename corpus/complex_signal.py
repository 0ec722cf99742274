"""Complex signals: rfft/irfft/fft2 filtering, view_as_real/complex, abs/angle/conj/polar, complex matmul, Adam on a complex parameter."""
import math

import torch


def r(x):
    return float(f"{x:.4g}")


def rc(z):
    return [(r(v.real), r(v.imag)) for v in z.tolist()]


torch.manual_seed(0)
n = 64
t = torch.arange(n, dtype=torch.float32) / n

# frequency-domain low-pass filtering of noisy signals, batch by batch
for batch in range(4):
    clean = torch.sin(2 * math.pi * (batch + 2) * t) + 0.5 * torch.cos(2 * math.pi * 3 * t)
    noisy = clean + 0.3 * torch.randn(n)
    spec = torch.fft.rfft(noisy)
    mask = torch.zeros_like(spec.real)
    mask[:8] = 1.0
    filtered = torch.fft.irfft(spec * mask, n=n)
    err_before = (noisy - clean).pow(2).mean()
    err_after = (filtered - clean).pow(2).mean()
    peak = spec.abs()[1:].argmax().item() + 1
    print(batch, spec.dtype, tuple(spec.shape), "peak bin", peak, "mse", r(err_before.item()), "->",
          r(err_after.item()), "dc", rc(spec[:1]), filtered.dtype)

# 2-D FFT of images with a Gaussian frequency mask
img = torch.randn(3, 16, 16)
fy = torch.fft.fftfreq(16).view(-1, 1)
fx = torch.fft.fftfreq(16).view(1, -1)
gauss = torch.exp(-(fx ** 2 + fy ** 2) / (2 * 0.1 ** 2))
for k in range(3):
    F2 = torch.fft.fft2(img[k])
    smooth = torch.fft.ifft2(F2 * gauss)
    print(k, F2.dtype, tuple(F2.shape), "imag max", r(smooth.imag.abs().max().item()) < 1e-5,
          "real std", r(smooth.real.std().item()), "orig std", r(img[k].std().item()),
          "parseval", r((F2.abs() ** 2).sum().item() / 256), r((img[k] ** 2).sum().item()))

# view_as_real / view_as_complex
z = torch.randn(5, dtype=torch.complex64)
for it in range(3):
    vr = torch.view_as_real(z)
    print(it, tuple(vr.shape), vr.stride(), vr.dtype, [r(v) for v in vr[:, 0].tolist()][:3])
    pairs = torch.randn(5, 2)
    zc = torch.view_as_complex(pairs)
    z = z * zc + 1j
    print("  ", zc.dtype, zc.shape, rc(zc[:2]), rc(z[:2]))

# abs, angle, conj, polar
for it in range(3):
    w = torch.randn(6, dtype=torch.complex64)
    mag, ph = w.abs(), w.angle()
    back = torch.polar(mag, ph)
    cj = w.conj()
    print(it, mag.dtype, ph.dtype, "roundtrip", bool(torch.allclose(back, w, atol=1e-6)),
          "conj is_conj", cj.is_conj(), "resolved", cj.resolve_conj().is_conj(),
          "w*conj(w) imag0", bool((w * cj).imag.abs().max() < 1e-6),
          "phase", [r(v) for v in ph.tolist()[:3]], "|w|^2", [r(v) for v in (w * cj).real.tolist()[:3]])
print("real/imag", torch.randn(3, dtype=torch.complex128).real.dtype, torch.complex(torch.ones(2), torch.zeros(2)).dtype,
      torch.is_complex(w), w.is_complex(), w.real.is_complex(), torch.tensor(1 + 2j).dtype)

# complex matmul
A = torch.randn(4, 4, dtype=torch.complex64)
x = torch.randn(4, 2, dtype=torch.complex64)
for it in range(3):
    yv = A @ x
    herm = A @ A.mH
    print(it, yv.dtype, tuple(yv.shape), rc(yv[0]), "herm diag imag0", bool(herm.diagonal().imag.abs().max() < 1e-5),
          "herm diag", [r(v) for v in herm.diagonal().real.tolist()])
    x = yv / yv.abs().max()

# fit a complex gain z so that z*x ~= y, with Adam on a complex parameter
true_z = torch.tensor([0.8 - 0.6j, -1.2 + 0.3j], dtype=torch.complex64)
xs = torch.randn(32, 2, dtype=torch.complex64)
ys = true_z * xs + 0.01 * torch.randn(32, 2, dtype=torch.complex64)
zp = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
opt = torch.optim.Adam([zp], lr=0.05)
for step in range(150):
    loss = (zp * xs - ys).abs().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if step == 0:
        print("grad dtype", zp.grad.dtype, rc(zp.grad))
    opt.step()
    if step % 30 == 29:
        print(step, "loss", r(loss.item()), "z", rc(zp.detach()))
print("final err", bool((zp.detach() - true_z).abs().max() < 0.05), opt.state[zp]["exp_avg"].dtype,
      opt.state[zp]["exp_avg_sq"].dtype)
