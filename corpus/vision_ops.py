"""Vision ops: interpolate (nearest, bilinear, bicubic, align_corners), grid_sample with an affine
grid, conv_transpose2d, unfold/fold, pixel_shuffle, adaptive pooling."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
img = torch.randn(2, 3, 8, 8)
for mode, kw in (("nearest", {}), ("bilinear", {"align_corners": False}), ("bilinear", {"align_corners": True}),
                 ("bicubic", {"align_corners": False})):
    up = F.interpolate(img, scale_factor=2, mode=mode, **kw)
    print("interpolate", mode, kw.get("align_corners"), tuple(up.shape), f"{up.sum().item():.4f}", f"{up[0, 0, 1, 3].item():.4f}")
down = F.interpolate(img, size=(5, 3), mode="area")
print("area", tuple(down.shape), f"{down.mean().item():.5f}")
theta = torch.tensor([[[0.9, -0.2, 0.1], [0.2, 0.9, -0.1]], [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
grid = F.affine_grid(theta, img.shape, align_corners=False)
warped = F.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
print("grid_sample", f"{warped[0].sum().item():.4f}", "identity", bool(torch.allclose(warped[1], img[1], atol=1e-5)))
warped_b = F.grid_sample(img, grid, mode="nearest", padding_mode="border", align_corners=False)
print("grid_sample nearest border", f"{warped_b.sum().item():.4f}")
w = torch.randn(3, 4, 3, 3)
y = F.conv_transpose2d(img, w, stride=2, padding=1, output_padding=1)
print("conv_transpose2d", tuple(y.shape), f"{y.sum().item():.4f}")
patches = F.unfold(img, kernel_size=3, padding=1, stride=1)
print("unfold", tuple(patches.shape))
folded = F.fold(patches, output_size=(8, 8), kernel_size=3, padding=1)
ones = F.fold(F.unfold(torch.ones_like(img), 3, padding=1), (8, 8), 3, padding=1)
print("fold/unfold", bool(torch.allclose(folded / ones, img, atol=1e-5)))
ps = F.pixel_shuffle(torch.randn(1, 12, 4, 4), 2)
print("pixel_shuffle", tuple(ps.shape), tuple(F.pixel_unshuffle(ps, 2).shape))
print("adaptive avg", [f"{v:.4f}" for v in F.adaptive_avg_pool2d(img, (2, 2))[0, 0].flatten().tolist()])
mp, idx = F.max_pool2d(img, 2, return_indices=True)
print("max_unpool", f"{F.max_unpool2d(mp, idx, 2).sum().item():.4f}", idx[0, 0, 0].tolist())
x = img.clone().requires_grad_(True)
F.grid_sample(x, grid, align_corners=False).pow(2).sum().backward()
print("grid_sample grad", f"{x.grad.abs().sum().item():.4f}")
print("pad reflect", F.pad(torch.arange(4.0).view(1, 1, 4), (2, 2), mode="reflect").flatten().tolist())
