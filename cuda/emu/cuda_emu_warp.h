// cuda_emu_warp.h (part of cuda_emu.h): warp-level operations: lanes and masks, the
// shuffle exchange, and the warp-synchronous collectives (warp_collective, warp_once) that
// ldmatrix, mma.sync (ptx_emu.h) and wmma (include/mma.h) are built on.
#pragma once

#include "cuda_emu_team.h"

namespace emu {

inline int my_lane() { return linear_tid() % 32; }

inline void check_mask(unsigned mask, const char* what) {
  const Warp& w = my_warp();
  const unsigned full = w.lanes == 32 ? 0xffffffffu : ((1u << w.lanes) - 1u);
  if ((mask & full) != full) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "%s with partial mask 0x%08x is not emulated (warp has %d lanes)",
                  what, mask, w.lanes);
    fail(msg);
  }
}

// Every lane publishes `var`, then reads lane `src` (its own value when src < 0).
template <typename T>
T exchange(T var, int src) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  Warp& w = my_warp();
  const int lane = my_lane();
  std::memcpy(&w.exchange[lane], &var, sizeof(T));
  w.barrier.wait(kShflWrite);
  T out = var;
  if (src >= 0 && src < w.lanes) std::memcpy(&out, &w.exchange[src], sizeof(T));
  w.barrier.wait(kShflRead);  // nobody overwrites the buffer before all have read
  return out;
}

// A warp-synchronous operation (ldmatrix, mma.sync): every lane passes `in`; once all 32
// have arrived, the last arrival runs fn(ins, outs) for the whole warp (lane l's operands
// at ins[l], its result to outs[l]) before any lane continues, so the operation sees
// memory and operands as of one instant, as the hardware's single instruction does; each
// lane then gets outs[its lane]. A lane that skips the call while others make it is a
// deadlock (or, at another barrier, a divergence) report.
template <typename In, typename Out>
Out warp_collective(int kind, const In& in, void (*fn)(const In* ins, Out* outs)) {
  static_assert(sizeof(In) <= kCollectiveBytes && sizeof(Out) <= kCollectiveBytes,
                "collective operands too large");
  Warp& w = my_warp();
  if (w.lanes != 32) fail("warp collectives need a full warp of 32 lanes");
  const int lane = my_lane();
  const unsigned slot = w.coll_seq[lane]++ & 1u;
  In* ins = reinterpret_cast<In*>(w.coll_in[slot]);
  Out* outs = reinterpret_cast<Out*>(w.coll_out[slot]);
  ins[lane] = in;
  struct Ctx {
    Warp* w;
    In* ins;
    Out* outs;
    void (*fn)(const In*, Out*);
  } ctx{&w, ins, outs, fn};
  OnComplete done{[](void* p) {
                    Ctx* c = static_cast<Ctx*>(p);
                    for (int l = 1; l < 32; ++l) {
                      if (c->w->coll_seq[l] != c->w->coll_seq[0]) {
                        fail("the lanes of a warp met at different warp collectives (a "
                             "divergent mma.sync/ldmatrix)");
                      }
                    }
                    c->fn(c->ins, c->outs);
                  },
                  &ctx};
#ifdef KVB_EMU_OS_THREADS
  w.barrier.wait(kind, done);
#else
  w.barrier.wait(kind, false, done);
#endif
  return outs[lane];
}

// A warp-synchronous operation whose operands every lane holds identically (an emulated
// WMMA fragment is the whole tile in every lane): once all 32 lanes have arrived, the last
// one runs fn(ctx, out) with its own ctx, once for the warp; every lane then reads the
// result at the returned pointer, valid until its next warp_once. (Computed 32 times, one
// per lane, a 32 x 8 x 16 product was most of the emulator's time in decode.)
inline const void* warp_once(int kind, void (*fn)(void* ctx, void* out), void* ctx) {
  Warp& w = my_warp();
  if (w.lanes != 32) fail("warp collectives need a full warp of 32 lanes");
  const int lane = my_lane();
  const unsigned slot = w.once_seq[lane]++ & 1u;
  struct Ctx {
    Warp* w;
    unsigned char* out;
    void (*fn)(void*, void*);
    void* ctx;
  } c{&w, w.once_out[slot], fn, ctx};
  OnComplete done{[](void* p) {
                    Ctx* x = static_cast<Ctx*>(p);
                    for (int l = 1; l < 32; ++l) {
                      if (x->w->once_seq[l] != x->w->once_seq[0]) {
                        fail("the lanes of a warp met at different warp-synchronous calls");
                      }
                    }
                    x->fn(x->ctx, x->out);
                  },
                  &c};
#ifdef KVB_EMU_OS_THREADS
  w.barrier.wait(kind, done);
#else
  w.barrier.wait(kind, false, done);
#endif
  return w.once_out[slot];
}

}  // namespace emu
