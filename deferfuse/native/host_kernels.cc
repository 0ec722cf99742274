// deferfuse's host kernels: matrix products of an XLA:CPU program run by torch's own CPU kernels.
//
// Convolutions call at::convolution and at::convolution_backward, the ops strict's autograd calls,
// which pick the same backend (oneDNN, or torch's own loops) from the same layouts; they return
// new tensors, copied into XLA's result buffers viewed with strict's output strides (a copy
// of the same layout).
//
// Each handler is an XLA FFI custom call (jax.ffi.ffi_call) that wraps XLA's buffers as
// at::Tensor views, without copying, and calls the structured CPU kernel strict PyTorch runs for
// the same aten op (at::cpu::mm_out, addmm_out, bmm_out, baddbmm_out).  An operand arrives as
// its physical buffer (the logical array permuted into the order strict's memory holds it) with
// the logical sizes and strides of strict's tensor as attributes, so a transposed operand is a
// view with swapped strides, which torch's kernel passes to BLAS as a transposition flag: the
// same call on the same layouts as strict, hence strict's bits.  deferfuse/native/hostkernels.py
// builds this file and registers the handlers; deferfuse/lower/host_products.py calls them.

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <cstdint>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using Dims = ffi::Span<const int64_t>;

namespace {

bool ScalarType(ffi::DataType type, c10::ScalarType* out) {
  switch (type) {
    case ffi::DataType::F32: *out = c10::ScalarType::Float; return true;
    case ffi::DataType::F64: *out = c10::ScalarType::Double; return true;
    case ffi::DataType::BF16: *out = c10::ScalarType::BFloat16; return true;
    case ffi::DataType::F16: *out = c10::ScalarType::Half; return true;
    default: return false;
  }
}

// The thread calling XLA may be the Python thread whose TorchDispatchMode (deferfuse's own
// DeferMode) is active: the kernels' own inner calls (expand, copy_, contiguous) must not reach
// Python.  Autograd is skipped too: these tensors never require grad.
struct BelowPython {
  c10::impl::ExcludeDispatchKeyGuard python{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                           c10::DispatchKey::PreDispatch, c10::DispatchKey::Functionalize})
      | c10::autograd_dispatch_keyset_with_ADInplaceOrView};
};

// A thread XLA created has not set OpenMP's and MKL's thread counts from torch's
// (torch.set_num_threads): what at::parallel_for does on a new thread, once per thread.
void InitThreads() {
  thread_local bool done = false;
  if (!done) {
    at::init_num_threads();
    done = true;
  }
}

ffi::Error View(const char* name, ffi::AnyBuffer buffer, Dims sizes, Dims strides, at::Tensor* out) {
  c10::ScalarType type;
  if (!ScalarType(buffer.element_type(), &type)) {
    return ffi::Error::InvalidArgument(std::string("deferfuse host kernel: operand ") + name +
                                       " has a dtype the host kernels do not take");
  }
  if (sizes.size() != strides.size()) {
    return ffi::Error::InvalidArgument(std::string("deferfuse host kernel: operand ") + name +
                                       ": sizes and strides differ in rank");
  }
  // the furthest element the view reaches must lie inside the buffer
  int64_t reach = 0, numel = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    numel *= sizes[i];
    if (sizes[i] > 0) reach += (sizes[i] - 1) * strides[i];
  }
  if (numel > 0 && static_cast<size_t>(reach) >= buffer.element_count()) {
    return ffi::Error::InvalidArgument(std::string("deferfuse host kernel: operand ") + name +
                                       "'s strides reach past its buffer");
  }
  *out = at::from_blob(buffer.untyped_data(), c10::IntArrayRef(sizes.begin(), sizes.size()),
                       c10::IntArrayRef(strides.begin(), strides.size()),
                       at::TensorOptions().dtype(type).device(at::kCPU));
  return ffi::Error::Success();
}

ffi::Error Result(ffi::Result<ffi::AnyBuffer>& buffer, at::Tensor* out) {
  c10::ScalarType type;
  if (!ScalarType(buffer->element_type(), &type)) {
    return ffi::Error::InvalidArgument("deferfuse host kernel: a result dtype the host kernels do not take");
  }
  Dims dims = buffer->dimensions();
  *out = at::from_blob(buffer->untyped_data(), c10::IntArrayRef(dims.begin(), dims.size()),
                       at::TensorOptions().dtype(type).device(at::kCPU));
  return ffi::Error::Success();
}

// Whether Python knows this thread: the user's threads, which run torch's own ops and so hold
// torch's OpenMP team anyway.  XLA runs a custom call on the thread that called it or, after
// work it spread over its intra-op pool, on one of that pool's threads, which Python does not
// know.  (Callable without the GIL: it reads a thread-local.)
bool PythonThread() {
  using GetThreadState = void* (*)();
  static const auto get = reinterpret_cast<GetThreadState>(
      dlsym(RTLD_DEFAULT, "PyGILState_GetThisThreadState"));
  return get == nullptr || get() != nullptr;
}

std::atomic<int64_t> guest_calls{0};
std::atomic<int64_t> served_calls{0};
std::atomic<int64_t> kernel_ns{0};
// A served call's hand-over: from its request (or the end of the kernel the serving thread was
// running then, whichever is later) to its kernel's start, plus from its kernel's end to the
// requesting thread's waking; the time a request waits while another kernel runs is not in it.
std::atomic<int64_t> handover_ns{0};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename Call>
ffi::Error RunHere(Call& call) {
  InitThreads();
  BelowPython below;
  const int64_t started = NowNs();
  ffi::Error result = ffi::Error::Success();
  try {
    call();
  } catch (const c10::Error& e) {
    result = ffi::Error::Internal(std::string("deferfuse host kernel: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    result = ffi::Error::Internal(std::string("deferfuse host kernel: ") + e.what());
  }
  kernel_ns.fetch_add(NowNs() - started, std::memory_order_relaxed);
  return result;
}

// Serving.  XLA starts a program on the thread that calls it, but once a fused kernel has been
// split over its intra-op pool the rest of the program goes on on whichever pool thread
// finished last, so in a training step's program every product was called on one of XLA's
// threads.  There a kernel cannot use the OpenMP team of the user's thread, which strict's
// kernels use (warm, spinning, with MKL's buffers made): on a thread made for the call it took
// 1.8x strict's time (a Llama step's 87 products: 130 ms against 70).  So the user's thread
// serves: hostkernels.served() hands the program's run to a driver thread, and the user's
// thread waits here for the kernels that program calls, runs each on its own team, and comes
// back when the driver says the run is over.  One thread serves at a time; while it does, a
// kernel called on any other thread is handed to it (one team runs every product, one after
// the other, as in strict).
struct Request {
  std::function<ffi::Error()> run;
  std::optional<ffi::Error> error;
  int64_t asked_ns = 0;   // (when it was queued; when its kernel ended, once it has)
  int64_t ended_ns = 0;
};

struct Server {
  std::mutex mu;
  std::condition_variable requested;   // a request queued, or the run is over
  std::condition_variable answered;    // a request done
  std::deque<Request*> queue;
  bool serving = false;
  bool over = false;
  pthread_t thread{};
};

Server* server = new Server();   // (never destroyed: XLA's threads may call at exit)

// Hands call to the serving thread and waits for it; false if no thread serves (or this is it).
template <typename Call>
bool Handed(Call& call, ffi::Error* result) {
  Server& s = *server;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.serving || pthread_equal(s.thread, pthread_self())) return false;
  Request request{[&] { return RunHere(call); }, std::nullopt, NowNs(), 0};
  s.queue.push_back(&request);
  s.requested.notify_one();
  s.answered.wait(lock, [&] { return request.error.has_value(); });
  *result = std::move(*request.error);
  served_calls.fetch_add(1, std::memory_order_relaxed);
  handover_ns.fetch_add(NowNs() - request.ended_ns, std::memory_order_relaxed);
  return true;
}

// torch's kernels parallelize with OpenMP, and GNU OpenMP gives every thread that starts a
// parallel region a team of its own, kept until that thread exits.  A team made on one of XLA's
// threads lives as long as the process, and once OpenMP manages more threads than there are
// cores, every team's idle workers stop spinning and sleep: each parallel region of the user's
// own torch ops then pays a wake-up (a 64x1024 mul_ went from 7 to 83 us, an AdamW step over
// 50 tensors from 8 to 50 ms, after one deferred RMSNorm + SwiGLU block).  So a kernel runs on
// the serving thread, or on a thread Python knows (the user's threads, which hold torch's team
// anyway), and elsewhere (a program run without a server) on a thread made for the call, with
// torch's thread count (strict's kernel, hence strict's bits), whose team goes when it ends.
template <typename Call>
ffi::Error Run(Call call) {
  ffi::Error handed = ffi::Error::Success();
  if (Handed(call, &handed)) return handed;
  thread_local const bool home = PythonThread();
  if (home) return RunHere(call);
  std::optional<ffi::Error> error;
  try {
    std::thread([&] { error.emplace(RunHere(call)); }).join();
  } catch (const std::system_error&) {
    // no thread to be had (a process at its limit): the kernel runs here, as it used to
    return RunHere(call);
  }
  guest_calls.fetch_add(1, std::memory_order_relaxed);
  return std::move(*error);
}

#define DEFERFUSE_TRY(expr)                  \
  do {                                       \
    ffi::Error error_ = (expr);              \
    if (error_.failure()) return error_;     \
  } while (0)

ffi::Error Product(bool batched, ffi::AnyBuffer a, Dims a_sizes, Dims a_strides, ffi::AnyBuffer b,
                   Dims b_sizes, Dims b_strides, ffi::Result<ffi::AnyBuffer> out) {
  at::Tensor ta, tb, to;
  DEFERFUSE_TRY(View("a", a, a_sizes, a_strides, &ta));
  DEFERFUSE_TRY(View("b", b, b_sizes, b_strides, &tb));
  DEFERFUSE_TRY(Result(out, &to));
  return Run([&] {
    if (batched) {
      at::cpu::bmm_out(to, ta, tb);
    } else {
      at::cpu::mm_out(to, ta, tb);
    }
  });
}

// beta and alpha arrive as float64 scalars computed by the program (runtime scalars: a Python
// float given to a Scalar parameter is an input of the computation, not a constant of it).
using Factor = ffi::BufferR0<ffi::F64>;

ffi::Error AddProduct(bool batched, ffi::AnyBuffer c, Dims c_sizes, Dims c_strides,
                      ffi::AnyBuffer a, Dims a_sizes, Dims a_strides, ffi::AnyBuffer b,
                      Dims b_sizes, Dims b_strides, Factor beta_buffer, Factor alpha_buffer,
                      ffi::Result<ffi::AnyBuffer> out) {
  const double beta = *beta_buffer.typed_data(), alpha = *alpha_buffer.typed_data();
  at::Tensor tc, ta, tb, to;
  DEFERFUSE_TRY(View("input", c, c_sizes, c_strides, &tc));
  DEFERFUSE_TRY(View("a", a, a_sizes, a_strides, &ta));
  DEFERFUSE_TRY(View("b", b, b_sizes, b_strides, &tb));
  DEFERFUSE_TRY(Result(out, &to));
  return Run([&] {
    if (batched) {
      at::cpu::baddbmm_out(to, tc, ta, tb, beta, alpha);
    } else {
      at::cpu::addmm_out(to, tc, ta, tb, beta, alpha);
    }
  });
}

ffi::Error Mm(ffi::AnyBuffer a, ffi::AnyBuffer b, Dims a_sizes, Dims a_strides, Dims b_sizes,
              Dims b_strides, ffi::Result<ffi::AnyBuffer> out) {
  return Product(false, a, a_sizes, a_strides, b, b_sizes, b_strides, out);
}

ffi::Error Bmm(ffi::AnyBuffer a, ffi::AnyBuffer b, Dims a_sizes, Dims a_strides, Dims b_sizes,
               Dims b_strides, ffi::Result<ffi::AnyBuffer> out) {
  return Product(true, a, a_sizes, a_strides, b, b_sizes, b_strides, out);
}

ffi::Error Addmm(ffi::AnyBuffer c, ffi::AnyBuffer a, ffi::AnyBuffer b, Factor beta, Factor alpha,
                 Dims c_sizes, Dims c_strides, Dims a_sizes, Dims a_strides, Dims b_sizes,
                 Dims b_strides, ffi::Result<ffi::AnyBuffer> out) {
  return AddProduct(false, c, c_sizes, c_strides, a, a_sizes, a_strides, b, b_sizes, b_strides,
                    beta, alpha, out);
}

ffi::Error Baddbmm(ffi::AnyBuffer c, ffi::AnyBuffer a, ffi::AnyBuffer b, Factor beta, Factor alpha,
                   Dims c_sizes, Dims c_strides, Dims a_sizes, Dims a_strides, Dims b_sizes,
                   Dims b_strides, ffi::Result<ffi::AnyBuffer> out) {
  return AddProduct(true, c, c_sizes, c_strides, a, a_sizes, a_strides, b, b_sizes, b_strides,
                    beta, alpha, out);
}

// A result buffer viewed with the logical sizes and strides of strict's result.
ffi::Error ResultView(const char* name, ffi::Result<ffi::AnyBuffer>& buffer, Dims sizes, Dims strides,
                      at::Tensor* out) {
  return View(name, *buffer, sizes, strides, out);
}

c10::IntArrayRef Ints(Dims dims) { return c10::IntArrayRef(dims.begin(), dims.size()); }

ffi::Error Convolution(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias, Dims x_sizes,
                       Dims x_strides, Dims w_sizes, Dims w_strides, Dims bias_sizes,
                       Dims bias_strides, Dims out_sizes, Dims out_strides, int64_t has_bias,
                       Dims stride, Dims padding, Dims dilation, int64_t transposed,
                       Dims output_padding, int64_t groups, ffi::Result<ffi::AnyBuffer> out) {
  at::Tensor tx, tw, tb, to;
  DEFERFUSE_TRY(View("input", x, x_sizes, x_strides, &tx));
  DEFERFUSE_TRY(View("weight", w, w_sizes, w_strides, &tw));
  if (has_bias) DEFERFUSE_TRY(View("bias", bias, bias_sizes, bias_strides, &tb));
  DEFERFUSE_TRY(ResultView("result", out, out_sizes, out_strides, &to));
  return Run([&] {
    std::optional<at::Tensor> b;
    if (has_bias) b = tb;
    to.copy_(at::convolution(tx, tw, b, Ints(stride), Ints(padding), Ints(dilation), transposed != 0,
                             Ints(output_padding), groups));
  });
}

ffi::Error ConvolutionBackward(ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::AnyBuffer w, Dims g_sizes,
                               Dims g_strides, Dims x_sizes, Dims x_strides, Dims w_sizes,
                               Dims w_strides, Dims gi_sizes, Dims gi_strides, Dims gw_sizes,
                               Dims gw_strides, Dims gb_sizes, Dims gb_strides, int64_t has_bias,
                               Dims bias_sizes, Dims stride, Dims padding, Dims dilation,
                               int64_t transposed, Dims output_padding, int64_t groups,
                               Dims output_mask, ffi::Result<ffi::AnyBuffer> grad_input,
                               ffi::Result<ffi::AnyBuffer> grad_weight,
                               ffi::Result<ffi::AnyBuffer> grad_bias) {
  if (output_mask.size() != 3) {
    return ffi::Error::InvalidArgument("deferfuse host kernel: output_mask must have 3 entries");
  }
  at::Tensor tg, tx, tw, gi, gw, gb;
  DEFERFUSE_TRY(View("grad_output", g, g_sizes, g_strides, &tg));
  DEFERFUSE_TRY(View("input", x, x_sizes, x_strides, &tx));
  DEFERFUSE_TRY(View("weight", w, w_sizes, w_strides, &tw));
  // (an output torch leaves undefined has an empty buffer, not viewed)
  if (output_mask[0]) DEFERFUSE_TRY(ResultView("grad_input", grad_input, gi_sizes, gi_strides, &gi));
  if (output_mask[1]) DEFERFUSE_TRY(ResultView("grad_weight", grad_weight, gw_sizes, gw_strides, &gw));
  if (output_mask[2]) DEFERFUSE_TRY(ResultView("grad_bias", grad_bias, gb_sizes, gb_strides, &gb));
  return Run([&] {
    at::OptionalIntArrayRef bias = has_bias ? at::OptionalIntArrayRef(Ints(bias_sizes)) : std::nullopt;
    auto [ri, rw, rb] = at::convolution_backward(
        tg, tx, tw, bias, Ints(stride), Ints(padding), Ints(dilation), transposed != 0,
        Ints(output_padding), groups, {output_mask[0] != 0, output_mask[1] != 0, output_mask[2] != 0});
    if (output_mask[0]) gi.copy_(ri);
    if (output_mask[1]) gw.copy_(rw);
    if (output_mask[2]) gb.copy_(rb);
  });
}

// Scaled dot-product attention: torch's CPU flash-attention kernel and its backward, the ops
// strict's F.scaled_dot_product_attention and its autograd call, on the same layouts (the
// query, key and value are views of the projections, heads transposed).  The mask is optional
// (an empty operand, not viewed, when absent), as is the scale (a float64 operand: it may be a
// runtime scalar).  The results are copied into XLA's buffers viewed with strict's strides.
struct Attention {
  at::Tensor q, k, v;
  std::optional<at::Tensor> mask;
  std::optional<double> scale;
};

ffi::Error AttentionOperands(ffi::AnyBuffer q, Dims q_sizes, Dims q_strides, ffi::AnyBuffer k,
                             Dims k_sizes, Dims k_strides, ffi::AnyBuffer v, Dims v_sizes,
                             Dims v_strides, ffi::AnyBuffer mask, Dims mask_sizes,
                             Dims mask_strides, int64_t has_mask, Factor scale, int64_t has_scale,
                             Attention* out) {
  DEFERFUSE_TRY(View("query", q, q_sizes, q_strides, &out->q));
  DEFERFUSE_TRY(View("key", k, k_sizes, k_strides, &out->k));
  DEFERFUSE_TRY(View("value", v, v_sizes, v_strides, &out->v));
  if (has_mask) {
    at::Tensor tm;
    DEFERFUSE_TRY(View("attn_mask", mask, mask_sizes, mask_strides, &tm));
    out->mask = tm;
  }
  if (has_scale) out->scale = *scale.typed_data();
  return ffi::Error::Success();
}

ffi::Error FlashAttention(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask,
                          Factor scale, Dims q_sizes, Dims q_strides, Dims k_sizes, Dims k_strides,
                          Dims v_sizes, Dims v_strides, Dims mask_sizes, Dims mask_strides,
                          Dims out0_sizes, Dims out0_strides, Dims out1_sizes, Dims out1_strides,
                          int64_t has_mask, int64_t has_scale, int64_t is_causal,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> logsumexp) {
  Attention a;
  DEFERFUSE_TRY(AttentionOperands(q, q_sizes, q_strides, k, k_sizes, k_strides, v, v_sizes, v_strides,
                                  mask, mask_sizes, mask_strides, has_mask, scale, has_scale, &a));
  at::Tensor to, tl;
  DEFERFUSE_TRY(ResultView("output", out, out0_sizes, out0_strides, &to));
  DEFERFUSE_TRY(ResultView("logsumexp", logsumexp, out1_sizes, out1_strides, &tl));
  return Run([&] {
    auto [ro, rl] = at::_scaled_dot_product_flash_attention_for_cpu(a.q, a.k, a.v, 0.0, is_causal != 0,
                                                                     a.mask, a.scale);
    to.copy_(ro);
    tl.copy_(rl);
  });
}

ffi::Error FlashAttentionBackward(ffi::AnyBuffer g, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                  ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                  ffi::AnyBuffer mask, Factor scale, Dims g_sizes, Dims g_strides,
                                  Dims q_sizes, Dims q_strides, Dims k_sizes, Dims k_strides,
                                  Dims v_sizes, Dims v_strides, Dims o_sizes, Dims o_strides,
                                  Dims lse_sizes, Dims lse_strides, Dims mask_sizes,
                                  Dims mask_strides, Dims out0_sizes, Dims out0_strides,
                                  Dims out1_sizes, Dims out1_strides, Dims out2_sizes,
                                  Dims out2_strides, int64_t has_mask, int64_t has_scale,
                                  int64_t is_causal, ffi::Result<ffi::AnyBuffer> grad_q,
                                  ffi::Result<ffi::AnyBuffer> grad_k,
                                  ffi::Result<ffi::AnyBuffer> grad_v) {
  Attention a;
  DEFERFUSE_TRY(AttentionOperands(q, q_sizes, q_strides, k, k_sizes, k_strides, v, v_sizes, v_strides,
                                  mask, mask_sizes, mask_strides, has_mask, scale, has_scale, &a));
  at::Tensor tg, to, tl, gq, gk, gv;
  DEFERFUSE_TRY(View("grad_out", g, g_sizes, g_strides, &tg));
  DEFERFUSE_TRY(View("out", o, o_sizes, o_strides, &to));
  DEFERFUSE_TRY(View("logsumexp", lse, lse_sizes, lse_strides, &tl));
  DEFERFUSE_TRY(ResultView("grad_query", grad_q, out0_sizes, out0_strides, &gq));
  DEFERFUSE_TRY(ResultView("grad_key", grad_k, out1_sizes, out1_strides, &gk));
  DEFERFUSE_TRY(ResultView("grad_value", grad_v, out2_sizes, out2_strides, &gv));
  return Run([&] {
    auto [rq, rk, rv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        tg, a.q, a.k, a.v, to, tl, 0.0, is_causal != 0, a.mask, a.scale);
    gq.copy_(rq);
    gk.copy_(rk);
    gv.copy_(rv);
  });
}

}  // namespace

// Serving (hostkernels.served): begin on the user's thread before the driver starts the program,
// serve there until the driver calls end, which it does when the run is over (or failed).
extern "C" void deferfuse_host_serve_begin() {
  std::lock_guard<std::mutex> lock(server->mu);
  server->serving = true;
  server->over = false;
  server->thread = pthread_self();
}

// Releasing the serving team's workers.  GNU OpenMP's idle workers spin for a while (its default
// spin count, ~3 ms) after each parallel region before they sleep.  While a program is served,
// XLA runs the fusions between its kernels, and beside them, on the same cores, so a kernel's
// workers spinning there took those cores from XLA (in a Llama step's program at size medium
// the fusions took ~100 ms more than with OpenMP's passive wait policy).  So when no kernel
// follows within release_after_us, the serving thread releases its team (omp_pause_resource_all:
// the workers exit; this thread's next parallel region, a kernel's or strict's, makes them
// again, with the same thread count, hence the same bits).  Where the OpenMP runtime has no
// omp_pause_resource_all (OpenMP < 5.0), nothing is released.
// (-1: never; hostkernels.served sets it from host_kernel_team_release_us before serving)
static std::atomic<int64_t> release_after_us{-1};
static std::atomic<int64_t> team_releases{0};

using PauseAll = int (*)(int);
static PauseAll FindPauseAll() {
  return reinterpret_cast<PauseAll>(dlsym(RTLD_DEFAULT, "omp_pause_resource_all"));
}

extern "C" void deferfuse_host_serve() {
  Server& s = *server;
  static const PauseAll pause_all = FindPauseAll();
  std::unique_lock<std::mutex> lock(s.mu);
  bool ran = false;   // (a kernel ran since the team was last released)
  int64_t last_end = 0;   // (when the last kernel served ended: handover_ns)
  for (;;) {
    const int64_t after_us = release_after_us.load(std::memory_order_relaxed);
    if (ran && pause_all != nullptr && after_us >= 0 &&
        !s.requested.wait_for(lock, std::chrono::microseconds(after_us),
                              [&] { return !s.queue.empty() || s.over; })) {
      lock.unlock();
      pause_all(1);   // (omp_pause_soft)
      team_releases.fetch_add(1, std::memory_order_relaxed);
      lock.lock();
      ran = false;
    }
    s.requested.wait(lock, [&] { return !s.queue.empty() || s.over; });
    while (!s.queue.empty()) {
      Request* request = s.queue.front();
      s.queue.pop_front();
      lock.unlock();
      handover_ns.fetch_add(NowNs() - std::max(request->asked_ns, last_end), std::memory_order_relaxed);
      ffi::Error result = request->run();
      last_end = NowNs();
      lock.lock();
      request->ended_ns = last_end;
      request->error.emplace(std::move(result));
      s.answered.notify_all();
      ran = true;
    }
    if (s.over) break;
  }
  s.serving = false;
}

extern "C" void deferfuse_host_serve_end() {
  std::lock_guard<std::mutex> lock(server->mu);
  server->over = true;
  server->requested.notify_one();
}

// A forked child has none of its parent's other threads: nothing serves there, and the lock
// may have been held by a thread that is gone.
static void AtForkChild() { server = new Server(); }
static const int at_fork = pthread_atfork(nullptr, nullptr, AtForkChild);

// How many calls ran on a thread made for them / on the serving thread; nanoseconds in handing
// served calls over (handover_ns) and in kernels.
extern "C" int64_t deferfuse_host_served_calls() { return served_calls.load(std::memory_order_relaxed); }
extern "C" int64_t deferfuse_host_handover_ns() { return handover_ns.load(std::memory_order_relaxed); }
extern "C" int64_t deferfuse_host_kernel_ns() { return kernel_ns.load(std::memory_order_relaxed); }
// How long the serving thread waits for the next kernel before it releases its team, -1 never
// (config host_kernel_team_release_us).
extern "C" void deferfuse_host_set_release_after_us(int64_t us) { release_after_us.store(us); }
extern "C" int64_t deferfuse_host_team_releases() { return team_releases.load(std::memory_order_relaxed); }
extern "C" int64_t deferfuse_host_guest_calls() { return guest_calls.load(std::memory_order_relaxed); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_convolution, Convolution,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<Dims>("input_sizes")
                                  .Attr<Dims>("input_strides")
                                  .Attr<Dims>("weight_sizes")
                                  .Attr<Dims>("weight_strides")
                                  .Attr<Dims>("bias_sizes")
                                  .Attr<Dims>("bias_strides")
                                  .Attr<Dims>("out0_sizes")
                                  .Attr<Dims>("out0_strides")
                                  .Attr<int64_t>("has_bias")
                                  .Attr<Dims>("stride")
                                  .Attr<Dims>("padding")
                                  .Attr<Dims>("dilation")
                                  .Attr<int64_t>("transposed")
                                  .Attr<Dims>("output_padding")
                                  .Attr<int64_t>("groups")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_convolution_backward, ConvolutionBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<Dims>("grad_output_sizes")
                                  .Attr<Dims>("grad_output_strides")
                                  .Attr<Dims>("input_sizes")
                                  .Attr<Dims>("input_strides")
                                  .Attr<Dims>("weight_sizes")
                                  .Attr<Dims>("weight_strides")
                                  .Attr<Dims>("out0_sizes")
                                  .Attr<Dims>("out0_strides")
                                  .Attr<Dims>("out1_sizes")
                                  .Attr<Dims>("out1_strides")
                                  .Attr<Dims>("out2_sizes")
                                  .Attr<Dims>("out2_strides")
                                  .Attr<int64_t>("has_bias")
                                  .Attr<Dims>("bias_sizes")
                                  .Attr<Dims>("stride")
                                  .Attr<Dims>("padding")
                                  .Attr<Dims>("dilation")
                                  .Attr<int64_t>("transposed")
                                  .Attr<Dims>("output_padding")
                                  .Attr<int64_t>("groups")
                                  .Attr<Dims>("output_mask")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_flash_attention, FlashAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Factor>()
                                  .Attr<Dims>("query_sizes")
                                  .Attr<Dims>("query_strides")
                                  .Attr<Dims>("key_sizes")
                                  .Attr<Dims>("key_strides")
                                  .Attr<Dims>("value_sizes")
                                  .Attr<Dims>("value_strides")
                                  .Attr<Dims>("attn_mask_sizes")
                                  .Attr<Dims>("attn_mask_strides")
                                  .Attr<Dims>("out0_sizes")
                                  .Attr<Dims>("out0_strides")
                                  .Attr<Dims>("out1_sizes")
                                  .Attr<Dims>("out1_strides")
                                  .Attr<int64_t>("has_mask")
                                  .Attr<int64_t>("has_scale")
                                  .Attr<int64_t>("is_causal")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_flash_attention_backward, FlashAttentionBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Factor>()
                                  .Attr<Dims>("grad_out_sizes")
                                  .Attr<Dims>("grad_out_strides")
                                  .Attr<Dims>("query_sizes")
                                  .Attr<Dims>("query_strides")
                                  .Attr<Dims>("key_sizes")
                                  .Attr<Dims>("key_strides")
                                  .Attr<Dims>("value_sizes")
                                  .Attr<Dims>("value_strides")
                                  .Attr<Dims>("out_sizes")
                                  .Attr<Dims>("out_strides")
                                  .Attr<Dims>("logsumexp_sizes")
                                  .Attr<Dims>("logsumexp_strides")
                                  .Attr<Dims>("attn_mask_sizes")
                                  .Attr<Dims>("attn_mask_strides")
                                  .Attr<Dims>("out0_sizes")
                                  .Attr<Dims>("out0_strides")
                                  .Attr<Dims>("out1_sizes")
                                  .Attr<Dims>("out1_strides")
                                  .Attr<Dims>("out2_sizes")
                                  .Attr<Dims>("out2_strides")
                                  .Attr<int64_t>("has_mask")
                                  .Attr<int64_t>("has_scale")
                                  .Attr<int64_t>("is_causal")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// mm and bmm take the same operands and attributes, as do addmm and baddbmm.
auto ProductBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Attr<Dims>("a_sizes")
      .Attr<Dims>("a_strides")
      .Attr<Dims>("b_sizes")
      .Attr<Dims>("b_strides")
      .Ret<ffi::AnyBuffer>();
}

auto AddProductBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<Factor>()
      .Arg<Factor>()
      .Attr<Dims>("c_sizes")
      .Attr<Dims>("c_strides")
      .Attr<Dims>("a_sizes")
      .Attr<Dims>("a_strides")
      .Attr<Dims>("b_sizes")
      .Attr<Dims>("b_strides")
      .Ret<ffi::AnyBuffer>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_mm, Mm, ProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_bmm, Bmm, ProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_addmm, Addmm, AddProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(deferfuse_host_baddbmm, Baddbmm, AddProductBinding());
