"""Boolean masks and data-dependent shapes whose counts change every iteration (none, some, all selected)."""
import torch

torch.manual_seed(0)
data = torch.randn(22, 5)
labels = torch.randint(0, 4, (22,))
BATCH = 6


def r(t):
    return [float(f"{v:.4g}") for v in t.flatten().tolist()]


for epoch in range(3):
    data = data.flip(0) * 1.1 if epoch else data
    for it, start in enumerate(range(0, data.shape[0], BATCH)):
        x = data[start:start + BATCH].clone()
        y = labels[start:start + BATCH]
        # threshold from the data: the first batch selects all, a late one none
        t = [-10.0, 0.5, 10.0, 0.0][it % 4]
        print("epoch", epoch, "batch", it, tuple(x.shape), "t", t)

        sel = torch.masked_select(x, x > t)
        print("  masked_select", tuple(sel.shape), r(sel))
        x2 = x.clone()
        x2[x2 > t] = 0
        print("  zeroed", int((x2 == 0).sum()), r(x2.sum(1)))
        mask = x2 < -0.5
        x2[mask] += 1
        print("  bumped", int(mask.sum()), r(x2[0]))

        rows, cols = (x > t).nonzero(as_tuple=True)
        print("  nonzero", rows.tolist(), cols.tolist())
        picked = x[rows, cols]
        print("  picked", tuple(picked.shape), f"{picked.sum().item():.4g}")
        (where_rows,) = torch.where(x[:, 0] > t)
        print("  where", where_rows.tolist())
        sub = x.index_select(0, where_rows)
        print("  index_select", tuple(sub.shape), r(sub.mean(1)) if sub.numel() else [])

        vals, counts = torch.unique(y, sorted=True, return_counts=True)
        print("  unique", vals.tolist(), counts.tolist())
        w = x[:, 1].abs()
        bc = torch.bincount(y, weights=w, minlength=4)
        print("  bincount", r(bc), torch.bincount(y).tolist())

        # split rows by label into groups of computed sizes, then join them back
        order = torch.argsort(y, stable=True)
        sizes = torch.bincount(y[order], minlength=4).tolist()
        groups = torch.split(x[order], sizes)
        print("  split", [tuple(gr.shape) for gr in groups])
        means = torch.stack([gr.mean(0) if gr.shape[0] else torch.zeros(5) for gr in groups])
        print("  group means", r(means[:, 0]))
        pieces = [gr[gr[:, 2] > 0] for gr in groups]
        joined = torch.cat(pieces)
        print("  cat", [p.shape[0] for p in pieces], tuple(joined.shape), r(joined[:, 2]))

        # a row-wise mask with a variable number of kept rows, used for a loss
        keep = (x.abs().max(1).values > 1.0)
        kept = x[keep]
        tgt = y[keep]
        print("  kept", keep.sum().item(), tuple(kept.shape), tgt.tolist())
        if kept.shape[0] > 0:
            loss = torch.nn.functional.cross_entropy(kept[:, :4], tgt)
            print("  loss", f"{loss.item():.4g}")
        else:
            print("  loss skipped")
        empty = x[x > 100]
        print("  empty", tuple(empty.shape), empty.sum().item(), empty.numel())
        x[x.abs() < 0.3] = float("nan")
        nn_mask = torch.isnan(x)
        print("  nan count", nn_mask.sum().item(), torch.nan_to_num(x, nan=-1.0)[nn_mask].tolist()[:3])
