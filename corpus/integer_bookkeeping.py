"""Integer bookkeeping: uint8 byte pipelines, bit ops and shifts, floor/trunc division of negatives, int64 wrap-around, small-int promotion."""
import torch

torch.manual_seed(0)
text = "deferred execution, fused: 0123 ÿ!"
raw = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def show(name, t):
    print(name, t.dtype, list(t.shape), t.tolist())


for it in range(3):
    print("== iter", it)
    b = raw.clone()
    # bytes: case folding, nibbles, xor "encryption", rotations
    upper = torch.where((b >= 97) & (b <= 122), b - 32, b)
    show("upper", upper)
    hi, lo = b >> 4, b & 0x0F
    show("nibbles", torch.stack([hi, lo]))
    key = torch.tensor(0x5A + it, dtype=torch.uint8)
    enc = b ^ key
    show("enc", enc)
    show("dec eq", (enc ^ key) == b)
    rot = (b << 3) | (b >> 5)                   # uint8 rotate left by 3: the high bits drop
    show("rot", rot)
    show("not", ~b)
    show("or", b | 0x80)
    show("sum u8", b.sum())                     # uint8 sum promotes to int64
    show("wrap add", b + 200)                   # uint8 + python int stays uint8, wraps
    show("mul u8", b * 3)
    show("u8 mod", b % (7 + it))
    show("u8 cumsum", b[:8].cumsum(0))
    show("bincount", torch.bincount(b.long() >> 5, minlength=8))

    # signed division of negatives
    a = torch.tensor([-7, -6, -1, 0, 1, 6, 7, -128, 127], dtype=torch.int64) * (it + 1)
    d = torch.tensor([2, -4, 3, -3, 2, -5, 3, 7, -8], dtype=torch.int64)
    show("floor", torch.div(a, d, rounding_mode="floor"))
    show("trunc", torch.div(a, d, rounding_mode="trunc"))
    show("//", a // d)
    show("%", a % d)
    show("fmod", torch.fmod(a, d))
    show("remainder scalar", torch.remainder(a, -3))
    show("true div", torch.div(a, d).mul(1000).round())
    a8 = a.to(torch.int8)
    show("int8", a8)
    show("int8 floor", torch.div(a8, 3, rounding_mode="floor"))
    show("int8 shift", a8 >> 1)
    show("int8 shift left", a8 << 2)
    show("int8 neg", -a8)
    show("int8 abs", a8.abs())

    # int64 overflow wraps
    big = torch.tensor([2**62, 2**62, 2**62, -(2**63)], dtype=torch.int64)
    show("cumsum wrap", big.cumsum(0))
    f = torch.arange(1, 26, dtype=torch.int64)
    show("cumprod wrap", f.cumprod(0)[-6:])
    show("prod wrap", f.prod())
    show("mul wrap", torch.tensor([3037000500], dtype=torch.int64) * 3037000500)
    i32 = torch.tensor([2**31 - 1, -(2**31), 65535], dtype=torch.int32)
    show("i32 add", i32 + 1)
    show("i32 mul", i32 * 65537)
    show("i32 sum", i32.sum())
    show("i32 cumsum", i32.cumsum(0))
    i16 = torch.tensor([32767, -32768, 300], dtype=torch.int16)
    show("i16 add", i16 + 1)
    show("i16 to u8", i16.to(torch.uint8))

    # promotion with python scalars and 0-dim tensors
    zero_dim = torch.tensor(1000)                # int64 0-dim
    show("u8 + 0dim i64", b[:4] + zero_dim)
    show("u8 + i16", b[:4] + torch.tensor([1, 2, 3, 4], dtype=torch.int16))
    show("i32 * float", i32 * 0.5)
    show("u8 + 0dim f", b[:4] + torch.tensor(0.5))
    show("i16 * 0dim f64", i16 * torch.tensor(2.0, dtype=torch.float64))
    show("bool + bool", torch.tensor([True, False]) + torch.tensor([True, True]))
    show("bool * 3", torch.tensor([True, False]) * 3)
    show("u8 - i8", b[:3] - torch.tensor([1, -1, 2], dtype=torch.int8))
    show("clamp i", a.clamp(-5, 5))
    show("clamp u8", b.clamp(min=40, max=100)[:6])
    show("clamp i32 float bound", i32.clamp(max=1.5))

    # bucketing
    v = torch.tensor([-3, 0, 1, 2, 5, 9, 10, 11, 20]) + it
    bounds = torch.tensor([0, 2, 5, 10])
    show("bucketize", torch.bucketize(v, bounds))
    show("bucketize right", torch.bucketize(v, bounds, right=True))
    show("histc", torch.histc(v.float(), bins=5, min=0, max=10))

    # bool reductions and selections
    m = b > 100
    show("any", m.any())
    show("all", m.all())
    show("count", m.sum())
    show("count dtype i32", m.sum(dtype=torch.int32))
    show("rowwise", m[:32].reshape(4, 8).sum(1))
    show("nonzero", m.nonzero().flatten())
    show("masked_select", b.masked_select(m))
    show("repeat_interleave", torch.repeat_interleave(torch.tensor([3, 1, 4]), torch.tensor([1, 0, 2 + it])))
    show("repeat_interleave counts", torch.repeat_interleave(torch.tensor([2, 0, 3])))
    ties = torch.tensor([3, 7, 7, 1, 7, 0]) * (it + 1)
    show("argmax ties", ties.argmax())
    show("argmin ties", torch.tensor([[2, 0, 0], [5, 5, 1]]).argmin(1))
    keys = torch.tensor([2, 1, 2, 1, 0, 2, 1, 0])
    s = keys.sort(stable=True)
    show("stable sort", s.indices)
    show("stable sort desc", keys.sort(descending=True, stable=True).indices)
    show("argsort stable", torch.argsort(keys, stable=True))
    show("where mix", torch.where(m[:5], b[:5], torch.tensor([-1, -2, -3, -4, -5], dtype=torch.int16)))
    show("where scalar", torch.where(m[:5], b[:5], -1))
    show("where float", torch.where(m[:5], b[:5], 0.5))
