"""k-means (cdist, argmin, bincount, index_add_/scatter_add_, empty clusters, torch.equal stop) then kNN votes with ties, unique, searchsorted."""
import torch

torch.manual_seed(0)


def kmeans(x, k, iters=20, use_scatter=False):
    n, d = x.shape
    # start from k distinct points, two of them duplicates of each other's neighbourhood
    cent = x[torch.randperm(n)[:k]].clone()
    cent[-1] = 100.0                      # a far-away centroid: its cluster stays empty
    assign = torch.full((n,), -1, dtype=torch.long)
    for it in range(iters):
        dist = torch.cdist(x, cent)
        new_assign = dist.argmin(dim=1)
        counts = torch.bincount(new_assign, minlength=k)
        sums = torch.zeros(k, d)
        if use_scatter:
            sums.scatter_add_(0, new_assign.unsqueeze(1).expand(-1, d), x)
        else:
            sums.index_add_(0, new_assign, x)
        empty = counts == 0
        # an empty cluster takes the point farthest from its centroid
        if bool(empty.any()):
            far = dist.gather(1, new_assign.unsqueeze(1)).squeeze(1).argmax()
            sums[empty] = x[far]
            counts = counts.masked_fill(empty, 1)
        cent = sums / counts.unsqueeze(1).to(sums.dtype)
        if torch.equal(new_assign, assign):
            return assign, counts, it
        assign = new_assign
    return assign, counts, iters


for trial in range(3):
    d = 2 if trial % 2 == 0 else 8
    centers = torch.randn(4, d) * 6
    x = torch.cat([c + torch.randn(15, d) for c in centers])
    assign, counts, iters = kmeans(x, 5, use_scatter=bool(trial % 2))
    sizes = torch.bincount(assign, minlength=5)
    print("trial", trial, "d", d, "iters", iters)
    print(" assign", assign.tolist())
    print(" counts", counts.tolist(), "sizes", sizes.tolist(), sizes.dtype, "total", int(sizes.sum()))
    # relabel clusters by first appearance, so the partition itself is compared
    uniq, inverse, ucounts = torch.unique(assign, return_inverse=True, return_counts=True)
    print(" unique", uniq.tolist(), ucounts.tolist(), inverse.tolist() == torch.searchsorted(uniq, assign).tolist())
    first = torch.full((5,), len(assign), dtype=torch.long).scatter_reduce(0, assign, torch.arange(len(assign)), "amin")
    print(" first index per cluster", first.tolist())

# kNN on integer grid points: distances are exact, so many neighbours tie
gx, gy = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
train = torch.stack([gx.flatten(), gy.flatten()], 1).float()
labels = (gx.flatten() + 2 * gy.flatten()) % 3
queries = torch.tensor([[2.5, 2.5], [0.0, 0.0], [5.0, 2.0], [3.0, 3.5], [1.5, 4.0]])
for k in (1, 4, 5):
    for rep in range(2):
        dist = torch.cdist(queries, train)
        order = dist.argsort(dim=1, stable=True)
        nn_idx = order[:, :k]
        votes = torch.stack([torch.bincount(labels[row], minlength=3) for row in nn_idx])
        pred = votes.argmax(dim=1)              # ties: the first (smallest) label
        mode_val = labels[nn_idx].mode(dim=1).values
        print("k", k, "rep", rep, "nn", nn_idx.tolist())
        print(" votes", votes.tolist(), "pred", pred.tolist(), "mode", mode_val.tolist())

# kNN with topk(largest=False) on continuous points: no ties among distances
xtr = torch.randn(40, 8)
ytr = torch.randint(0, 4, (40,))
for rep in range(3):
    xq = torch.randn(6, 8)
    d = torch.cdist(xq, xtr)
    vals, idx = d.topk(5, dim=1, largest=False)
    votes = torch.zeros(6, 4, dtype=torch.long).scatter_add_(1, ytr[idx], torch.ones_like(idx))
    pred = votes.argmax(1)
    sorted_d, _ = d.sort(dim=1)
    pos = torch.searchsorted(sorted_d, vals)
    print("rep", rep, "idx", idx.tolist(), "pred", pred.tolist(), "votes", votes.tolist())
    print(" positions", pos.tolist(), "dist", [round(v, 4) for v in vals[:, 0].tolist()])
    counts = torch.bincount(pred, minlength=4)
    print(" histogram", counts.tolist(), "dtype", counts.dtype, "agree", torch.equal(pred, votes.max(1).indices))
