# ruff: noqa: E501 - the variants splice lines of kernel text
"""Write variants of mtpcli/kernels/gated_delta.py for bench_gdn_geometry.py --module.

plain:   the kept states' rows as plain 16-byte stores (not evict-first)
bulk:    the kept states staged in shared memory, each warp's rows (R x Dk floats, contiguous
         in the output) sent by one sm_90 cp.async.bulk store, two slots a warp
bulkall: bulk, and the final state too (a third slot)
cluster: the conv kernel in sm_90 clusters of a value head's 8 threadgroups, which make a
         chunk's q/k once between them (a task a warp of the cluster, written into all 8
         threadgroups' shared memory) instead of once each; cluster barriers around it
(taps and ptrs, session 30, are in the product since: its q/k conv's tap pointers, and the y
and kept-state pointers moved a step at a time; commit a1628b4 has their generator)

    python scripts/gdn_variants/make_variants.py DIR [SOURCE]

The variants splice the text of the kernel before 43c46ab (lanes a row as a parameter, q/k in
natural order in shared memory; lds4 is in the product since), so all but plain need that
version as SOURCE: ``git show 43c46ab~1:mtpcli/kernels/gated_delta.py > /tmp/gd_old.py``.
A variant that does not apply to SOURCE is skipped with a note. The ko_* knock-outs
(KNOCKOUTS) apply to the product: each takes one part out of a step, its outputs wrong by
design, for timing only: ``VARIANTS="head ko_obfly ko_kvbfly ko_bfly1 ko_vtake ko_ystore
ko_qk1 ko_steps1" STEPS=" " bash scripts/gdn_variants/device_sweeps.sh``. (f32w, the conv
weights read as a float32 copy in float4s, is in the product since e244a54.) onebfly: a step's
dot products of the old state under one butterfly, measured not faster (session 33).
CANDIDATES: session 34's na2, qkh and both (qkh_na2), measured not faster.
pipe2: a step's y butterfly beside the next step's kv butterfly, bitwise the product,
measured 0.012 ms slower at T = 3 in the real step (session 36); pipe: the same behind
a branch, which ptxas serialises (not run). ko_keep / ko_qk1keep: knock-outs of the
kept states (and the later q/k); in the real step 1.21x and 1.20x a decode step (session 37).
"""

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "mtpcli/kernels/gated_delta.py"

BULK_HEADER = r"""
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void gd_bulk_store(float* dst, const float* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :: "l"(dst), "r"(static_cast<unsigned>(__cvta_generic_to_shared(src))),
                  "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void gd_bulk_wait_read1() {
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}
__device__ __forceinline__ void gd_bulk_wait_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void gd_bulk_fence() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#else
static inline void gd_bulk_store(float* dst, const float* src, unsigned bytes) {
  std::memcpy(dst, src, bytes);
}
static inline void gd_bulk_wait_read1() {}
static inline void gd_bulk_wait_read0() {}
static inline void gd_bulk_fence() {}
#endif
"""

# A lane's row into a shared row: plain 16-byte stores (the half's 16 lanes: 256 B together).
SH_ROW = r"""#define SH_ROW(dst, src) \
      if (VW == 4) { \
        for (int i = 0; i < SPL; i += 4) \
          *(float4*)((dst) + COL(i)) = \
              FLOAT4((src)[i], (src)[i + 1], (src)[i + 2], (src)[i + 3]); \
      } else { \
        for (int i = 0; i < SPL; ++i) (dst)[COL(i)] = (src)[i]; \
      }
    __align__(128) SHARED float st_sh[WARPS][NSLOT][R * Dk];  // a warp's rows, staged
"""

KEEP_BULK = """if (t + 1 < T) {
          const int slot = t & 1;
          if (t >= 2 && lane == 0) gd_bulk_wait_read1();  // the slot's last copy has read it
          WARP_SYNC;
          for (int r = 0; r < RH; ++r) SH_ROW(&st_sh[warp][slot][(half * RH + r) * Dk], s[r]);
          gd_bulk_fence();
          WARP_SYNC;
          if (lane == 0)
            gd_bulk_store(states + (((size_t)t * B * Hv + n) * Dv + dv) * Dk, &st_sh[warp][slot][0],
                          R * Dk * 4);
        }"""

FINAL = """    for (int r = 0; r < RH; ++r) {
      DEVICE float* s_out = state_out + ((size_t)n * Dv + dh + r) * Dk;
      STORE_ROW(s_out, s[r]);
    }
"""
FINAL_BULK = """    for (int r = 0; r < RH; ++r) SH_ROW(&st_sh[warp][NSLOT - 1][(half * RH + r) * Dk], s[r]);
    gd_bulk_fence();
    WARP_SYNC;
    if (lane == 0) {
      gd_bulk_store(state_out + ((size_t)n * Dv + dv) * Dk, &st_sh[warp][NSLOT - 1][0],
                    R * Dk * 4);
    }
    if (lane == 0) gd_bulk_wait_read0();
"""


def sub(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"not found once: {old[:60]!r}")
    return text.replace(old, new)


LDS4_READ = """        if (VW == 4) {
          for (int i = 0; i < SPL; i += 4) {
            const float4 q4 = *(const float4*)&qk_sh[j][0][COL(i)];
            const float4 k4 = *(const float4*)&qk_sh[j][1][COL(i)];
            qn[i] = q4.x, qn[i + 1] = q4.y, qn[i + 2] = q4.z, qn[i + 3] = q4.w;
            kn[i] = k4.x, kn[i + 1] = k4.y, kn[i + 2] = k4.z, kn[i + 3] = k4.w;
          }
        } else {
          for (int i = 0; i < SPL; ++i) {
            qn[i] = qk_sh[j][0][COL(i)];
            kn[i] = qk_sh[j][1][COL(i)];
          }
        }
"""


def lds4(text: str, gb2: bool = False) -> str:
    text = sub(
        text,
        "    SHARED float qk_sh[CH][2][Dk];",
        "    __align__(16) SHARED float qk_sh[CH][2][Dk];",
    )
    text = sub(
        text,
        "qk_sh[j][isq ? 0 : 1][SH(lane * NPT + i)] = x[i];",
        "qk_sh[j][isq ? 0 : 1][lane * NPT + i] = x[i];",
    )
    text = sub(
        text,
        """        for (int i = 0; i < SPL; ++i) {
          qn[i] = qk_sh[j][0][i * LH + hl];
          kn[i] = qk_sh[j][1][i * LH + hl];
        }
""",
        LDS4_READ,
    )
    if gb2:
        text = sub(
            text, "    SHARED float gb_sh[CH][2];", "    __align__(8) SHARED float gb_sh[CH][2];"
        )
        text = sub(
            text,
            "const float gt = gb_sh[j][0], bt = gb_sh[j][1];",
            "const float2 gb2 = *(const float2*)&gb_sh[j][0];\n"
            "        const float gt = gb2.x, bt = gb2.y;",
        )
    return text


# The value rows' conv made once a chunk, one (row, step) a lane, where their inputs are loaded:
# a step takes its activated values by one shuffle (the per-step conv and window slide gone).
VACT = """      if (lane < C * R) V_LOAD(xin, lane % R, t0 + lane / R);
      float vact = 0.0f;  // lane l < C R: value row l % R at step t0 + l / R, activated
      {
        const int r_ = lane % R, s_ = lane / R;
        const int c_ = cv + r_;
        float acc_ = 0.0f;
        for (int kk = 0; kk < CK; ++kk) {
          const int d = TW - kk;  // steps back
          const float sh_ = LANE_SHUFFLE(xin, LANE_OFFSET((lane - d * R) & 31));
          float in_ = xin;
          if (d > 0) {
            if (s_ - d >= 0) in_ = sh_;
            else if (lane < C * R) in_ = static_cast<float>(CONV_IN(c_, t0 + s_ - d));
          }
          acc_ = acc_ + static_cast<float>(conv_w[c_ * CK + kk]) * in_;
        }
        if (lane < C * R) CONV_ACT(vact, acc_);
      }
"""
LOAD_LINE = "      if (lane < C * R) V_LOAD(xin, lane % R, t0 + lane / R);\n"
XV_LINE = (
    "        for (int r = 0; r < RH; ++r) xv[r] = LANE_SHUFFLE(xin, "
    "LANE_OFFSET(j * R + half * RH + r));\n"
)
PLAIN_TAKE = '    "V_TAKE": "for (int r = 0; r < RH; ++r) vt[r] = xv[r];",'


def vact(text: str) -> str:
    text = sub(text, LOAD_LINE, "      VALUE_ACT\n")
    text = sub(text, XV_LINE, "")
    new_plain = (
        '    "V_TAKE": '
        + repr(XV_LINE.strip() + "\n        for (int r = 0; r < RH; ++r) vt[r] = xv[r];")
        + ",\n"
        '    "VALUE_ACT": ' + repr(LOAD_LINE.strip()) + ","
    )
    text = sub(text, PLAIN_TAKE, new_plain)
    i = text.index('    "V_TAKE": """for (int r = 0; r < RH; ++r) {\n          vw[r][TW] = xv[r];')
    j = text.index('}""",', i) + len('}""",')
    conv = (
        '    "V_TAKE": "for (int r = 0; r < RH; ++r) vt[r] = LANE_SHUFFLE(vact, '
        'LANE_OFFSET(j * R + half * RH + r));",\n    "VALUE_ACT": ' + repr(VACT) + ","
    )
    return text[:i] + conv + text[j:]


PRELOAD = """    float wpre[CK], wk[CK];  // lane l < CH R: row l % R's conv weights, and the window inputs
    {                        // the first chunk needs d steps back (at d - 1)
      const int r_ = lane % R, s_ = lane / R;
      for (int k = 0; k < CK; ++k) wk[k] = static_cast<float>(conv_w[(cv + r_) * CK + k]);
      for (int d = 1; d < CK; ++d)
        wpre[d - 1] = lane < CH * R && s_ - d < 0 ? static_cast<float>(CONV_IN(cv + r_, s_ - d)) : 0.0f;
    }
"""


def vact2(text: str) -> str:
    text = vact(text)
    text = sub(
        text, "    float vk[RH][CK], vw[RH][CK];", PRELOAD + "    float vk[RH][CK], vw[RH][CK];"
    )
    text = sub(
        text,
        "in_ = static_cast<float>(CONV_IN(c_, t0 + s_ - d));",
        "in_ = t0 == 0 ? wpre[d - 1] : static_cast<float>(CONV_IN(c_, t0 + s_ - d));",
    )
    text = sub(text, "static_cast<float>(conv_w[c_ * CK + kk]) * in_", "wk[kk] * in_")
    return text


CLUSTER_HEADER = r"""
__device__ __forceinline__ unsigned gd_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned gd_mapa(unsigned a, unsigned rank) {
  unsigned ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
  return ra;
}
__device__ __forceinline__ void gd_st_cluster(unsigned a, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ void gd_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}
"""
CL_PUT = """{
          const unsigned a0 = static_cast<unsigned>(
              __cvta_generic_to_shared(&qk_sh[j][isq ? 0 : 1][0]));
          for (int rk = 0; rk < CLN; ++rk) {
            const unsigned ra = gd_mapa(a0, rk);
            for (int i = 0; i < NPT; ++i) gd_st_cluster(ra + 4u * SH(lane * NPT + i), x[i]);
          }
        }"""
LOCAL_PUT = "for (int i = 0; i < NPT; ++i) qk_sh[j][isq ? 0 : 1][SH(lane * NPT + i)] = x[i];"
CL_SPLICE = """    cl = conv and not metal
    for token, text in (("CL_SYNC", "gd_cluster_sync()" if cl else "BARRIER"),
                        ("CL_RANK", "static_cast<int>(gd_rank())" if cl else "0"),
                        ("CL_PUT", _CL_PUT if cl else _LOCAL_PUT), ("CLN", "CLUSTER" if cl else "1")):
        source = source.replace(token, text)
"""
SPELL_LINE = '    return spell(source.replace("THREAD_INDICES", _THREAD_INDICES[metal]), metal)'


def cluster(text: str, size: int = 8) -> str:
    text = sub(
        text,
        "        BARRIER;  // every warp is done with the last chunk",
        "        CL_SYNC;  // every warp of the cluster is done with the last chunk",
    )
    text = sub(
        text,
        "      for (int u = warp; u < 2 * C; u += WARPS) {",
        "      for (int u = warp * CLN + crank; u < 2 * C; u += WARPS * CLN) {",
    )
    text = sub(text, "        " + LOCAL_PUT, "        CL_PUT")
    text = sub(
        text,
        "        gb_sh[lane][1] = bt;\n      }\n      BARRIER;",
        "        gb_sh[lane][1] = bt;\n      }\n      CL_SYNC;",
    )
    text = sub(
        text,
        "    const int half = lane / LH, hl = lane % LH;",
        "    const int crank = CL_RANK;\n    const int half = lane / LH, hl = lane % LH;",
    )
    text = sub(text, SPELL_LINE, CL_SPLICE + SPELL_LINE)
    text = sub(
        text,
        "_kernels: dict = {}",
        "_kernels: dict = {}\n_CL_HEADER = r'''"
        + CLUSTER_HEADER
        + "'''\n_CL_PUT = '''"
        + CL_PUT
        + "'''\n_LOCAL_PUT = '''"
        + LOCAL_PUT
        + "'''",
    )
    text = sub(
        text,
        "header = _METAL_HEADER if metal else launch_bounds(_WARPS, CONV_MIN_BLOCKS) "
        'if conv else ""',
        "header = _METAL_HEADER if metal else (_CL_HEADER + launch_bounds(_WARPS, "
        'CONV_MIN_BLOCKS).replace(")\\n", ") __cluster_dims__(1, 8, 1)\\n")) if conv else ""',
    )
    return text.replace("CLUSTER", str(size)).replace("(1, 8, 1)", f"(1, {size}, 1)")


# Knock-outs (timing only; their outputs are wrong by design): each takes one part out of the
# product's step, so that the sweep's T = 3 - T = 1 shows what that part costs a step.
KNOCKOUTS = {
    "ko_obfly": [("for (int r = 0; r < RH; ++r) o[r] = o[r] + XOR_SHUFFLE(o[r], off);", ";")],
    "ko_kvbfly": [("for (int r = 0; r < RH; ++r) kv[r] = kv[r] + XOR_SHUFFLE(kv[r], off);", ";")],
    "ko_bfly1": [
        (
            "for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {",
            "for (LANE_OFFSET off = LH / 2; off >= LH / 2; off >>= 1) {",
        )
    ],
    "ko_vtake": [("CONV_ACT(vt[r], acc_);", "vt[r] = acc_;")],
    "ko_ystore": [
        (
            "for (int r = 0; r < RH; ++r) y_[grp * RH + r] = static_cast<InT>(o[r]);",
            "for (int r = 0; r < RH; ++r) if (o[r] == 1234.5f) y_[grp * RH + r] = 0;",
        )
    ],
    "ko_qk1": [
        (
            "for (int u = warp; u < 2 * C; u += WARPS) {",
            "for (int u = warp; u < (t0 == 0 ? 2 : 2 * C); u += WARPS) {",
        )
    ],
    "ko_keep": [
        (
            "            STORE_ROW(s_t, s[r]);",
            "            if (s[r][0] == 1234.5f) s_t[0] = 0.0f;",
        )
    ],
    "ko_steps1": [
        (
            "for (int j = 0; j < C; ++j) {\n        const int t = t0 + j;",
            "for (int j = 0; j < (t0 == 0 ? 1 : C); ++j) {\n        const int t = t0 + j;",
        )
    ],
}

# ko_qk1keep (session 36): neither the later steps' q/k nor the kept states, what a T = 3
# block would cost were both free.
KNOCKOUTS["ko_qk1keep"] = KNOCKOUTS["ko_qk1"] + KNOCKOUTS["ko_keep"]

# Candidates (session 34). na2: a lane's 8 columns summed in 2 partial sums of 4 (a shorter
# dependent chain; other bits, chain parity as before). qkh: the chunk's q/k rows in shared
# memory in the input dtype, which holds them exactly (normalised q/k are rounded to it), so
# a step's shared reads move half the bytes; bitwise the product.
CANDIDATES = {
    "na2": [
        (
            "constexpr int NA = SPL >= 32 ? 4 : SPL >= 16 ? 2 : 1;",
            "constexpr int NA = SPL >= 32 ? 4 : SPL >= 8 ? 2 : 1;",
        )
    ],
    "qkh": [
        ("ALIGN16 SHARED float qk_sh[CH][2][Dk];", "ALIGN16 SHARED InT qk_sh[CH][2][Dk];"),
        (
            "qk_sh[j][isq ? 0 : 1][lane * NPT + i] = x[i];",
            "qk_sh[j][isq ? 0 : 1][lane * NPT + i] = static_cast<InT>(x[i]);",
        ),
        (
            "for (int i = 0; i < SPL; ++i) {\n"
            "          qn[i] = qk_sh[j][0][COL(i)];  // a run: one 16-byte read on CUDA\n"
            "          kn[i] = qk_sh[j][1][COL(i)];\n"
            "        }",
            "for (int i = 0; i < SPL; i += VW) {  // a run: one 8-byte read (2-byte types)\n"
            "          struct alignas(VW * sizeof(InT)) Run { InT v[VW]; };\n"
            "          const Run rq = *(const Run*)&qk_sh[j][0][COL(i)];\n"
            "          const Run rk = *(const Run*)&qk_sh[j][1][COL(i)];\n"
            "          for (int m = 0; m < VW; ++m) {\n"
            "            qn[i + m] = static_cast<float>(rq.v[m]);\n"
            "            kn[i + m] = static_cast<float>(rk.v[m]);\n"
            "          }\n"
            "        }",
        ),
    ],
}
CANDIDATES["qkh_na2"] = CANDIDATES["qkh"] + CANDIDATES["na2"]

# pipe (session 36): a step's y butterfly is deferred to run beside the next step's kv
# butterfly (two independent chains of shuffles side by side), the last step's after the loop.
# The same operations on the same values: bitwise the product, T = 1 unchanged but for where
# its one y butterfly sits.
Y_BFLY = """        for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {
          for (int r = 0; r < RH; ++r) o[r] = o[r] + XOR_SHUFFLE(o[r], off);
        }
        if (hl == 0) {
          for (int r = 0; r < RH; ++r) y_[grp * RH + r] = static_cast<InT>(o[r]);
        }
"""
KV_BFLY = """        for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {
          for (int r = 0; r < RH; ++r) kv[r] = kv[r] + XOR_SHUFFLE(kv[r], off);
        }
"""
PIPE = [
    (
        "    float xin = 0.0f;",
        "    float o[RH] = {};  // the last step's y partial sums, summed beside this step's kv\n"
        "    float xin = 0.0f;",
    ),
    ("        float kv[RH], o[RH];\n", "        float kv[RH];\n"),
    (Y_BFLY, ""),
    (
        KV_BFLY,
        """        for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {
          for (int r = 0; r < RH; ++r) kv[r] = kv[r] + XOR_SHUFFLE(kv[r], off);
          PIPE_GUARD {
            for (int r = 0; r < RH; ++r) o[r] = o[r] + XOR_SHUFFLE(o[r], off);
          }
        }
        if (t > 0 && hl == 0) {
          for (int r = 0; r < RH; ++r) y_[grp * RH + r - Hv * Dv] = static_cast<InT>(o[r]);
        }
""",
    ),
    (
        "    for (int r = 0; r < RH; ++r) {\n      DEVICE float* s_out",
        "    for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {\n"
        "      for (int r = 0; r < RH; ++r) o[r] = o[r] + XOR_SHUFFLE(o[r], off);\n"
        "    }\n"
        "    if (hl == 0) {\n"
        "      for (int r = 0; r < RH; ++r) y_[grp * RH + r - Hv * Dv] = static_cast<InT>(o[r]);\n"
        "    }\n"
        "    for (int r = 0; r < RH; ++r) {\n      DEVICE float* s_out",
    ),
]
# pipe: the y butterfly beside the next kv one only after a first step (a branch a level);
# pipe2: always beside it (at the first step on zeros, its result unused), no branch.
CANDIDATES["pipe"] = [(old, new.replace("PIPE_GUARD", "if (t > 0)")) for old, new in PIPE]
CANDIDATES["pipe2"] = [(old, new.replace("PIPE_GUARD", "")) for old, new in PIPE]


# onebfly: y = S'q = g (S q) + delta (k . q), where S' = g S + k delta, so a step's two dot
# products of a row with the state (with k, then with q) are both taken of the old state and
# summed by one butterfly with k . q, instead of a second butterfly after the update: a step's
# chain of dependent shuffles half as long. A different rounding (not bitwise HEAD), the same
# arithmetic at every T (chain parity holds).
ONEBFLY_NEW = """        float kv[RH], o[RH], kq;
        {
          float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int i = 0; i < SPL; ++i) p[i % NA] = p[i % NA] + kn[i] * qn[i];
          kq = PSUM(p);
        }
        for (int r = 0; r < RH; ++r) {
          float p[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int i = 0; i < SPL; ++i) {
            p[i % NA] = p[i % NA] + s[r][i] * kn[i];
            pq[i % NA] = pq[i % NA] + s[r][i] * qn[i];
          }
          kv[r] = PSUM(p);
          o[r] = PSUM(pq);
        }
        for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {
          kq = kq + XOR_SHUFFLE(kq, off);
          for (int r = 0; r < RH; ++r) {
            kv[r] = kv[r] + XOR_SHUFFLE(kv[r], off);
            o[r] = o[r] + XOR_SHUFFLE(o[r], off);
          }
        }
        for (int r = 0; r < RH; ++r) {
          const float delta = (vt[r] - gt * kv[r]) * bt;
          for (int i = 0; i < SPL; ++i) {
            s[r][i] = s[r][i] * gt;
            s[r][i] = s[r][i] + kn[i] * delta;
          }
          o[r] = gt * o[r] + delta * kq;
        }
"""
# Every variant made by plain (old, new) splices: the knock-outs and product candidates.
SPLICED = KNOCKOUTS | CANDIDATES
# The product's step from its dot products to the y butterfly, which onebfly replaces.
STEP_FROM = "        float kv[RH], o[RH];\n"
STEP_TO = "o[r] = o[r] + XOR_SHUFFLE(o[r], off);\n        }\n"


def onebfly(text: str) -> str:
    i = text.index(STEP_FROM)
    return text[:i] + ONEBFLY_NEW + text[text.index(STEP_TO, i) + len(STEP_TO) :]


# A knock-out's outputs are wrong by design. So that the real step (bench_gdn_geometry.py
# --step) runs it instead of the ops reference, it skips the self-check, and KNOCKOUT tells the
# step to trust a verify's batched block (the row policy would find it unequal to T steps).
KNOCKOUT_TAIL = """

KNOCKOUT = True


def _self_check_conv(*args, **kwargs):
    return None
"""


def spliced(name: str, text: str) -> str:
    for old, new in SPLICED[name]:
        if old not in text:
            raise SystemExit(f"not found: {old[:60]!r}")
        text = text.replace(old, new)
    if name in KNOCKOUTS:  # wrong by design: run unchecked and batched (see KNOCKOUT_TAIL)
        text += KNOCKOUT_TAIL
    return text


def variant(name: str, src: Path = SRC) -> str:
    text = src.read_text()
    if name in SPLICED:
        return spliced(name, text)
    if name == "onebfly":
        return onebfly(text)
    if name.startswith("cluster"):
        return cluster(text, int(name[len("cluster") :] or 8))
    if name == "vact2":
        return vact2(text)
    if name == "lds4vact2":
        return vact2(lds4(text))
    if name == "vact":
        return vact(text)
    if name == "lds4vact":
        return vact(lds4(text))
    if name == "lds4":
        return lds4(text)
    if name == "lds4gb":
        return lds4(text, gb2=True)
    if name == "plain":
        text = sub(
            text,
            "            STORE_ROW(s_t, s[r]);",
            "            if (VW == 4) { for (int i = 0; i < SPL; i += 4) *(DEVICE float4*)(s_t + COL(i)) ="
            " FLOAT4(s[r][i], s[r][i + 1], s[r][i + 2], s[r][i + 3]); }"
            " else { for (int i = 0; i < SPL; ++i) s_t[COL(i)] = s[r][i]; }",
        )
        return text
    nslot = 3 if name == "bulkall" else 2
    text = sub(text, '_TEMPLATE = """\n', f'_TEMPLATE = """\n    constexpr int NSLOT = {nslot};\n')
    text = sub(
        text, "    SHARED float qk_sh[CH][2][Dk];", SH_ROW + "    SHARED float qk_sh[CH][2][Dk];"
    )
    old_keep = text[text.index('_KEEP = """') + len('_KEEP = """') :]
    old_keep = old_keep[: old_keep.index('"""')]
    text = sub(text, old_keep, KEEP_BULK)
    if name == "bulkall":
        text = sub(text, FINAL, FINAL_BULK)
    else:  # the kernel must not exit before the last copy has read its slot
        text = sub(text, FINAL, FINAL + "    if (lane == 0) gd_bulk_wait_read0();\n")
    # CUDA only: the header carries the helpers; Metal would need its own (not built here)
    text = sub(
        text,
        "header = _METAL_HEADER if metal else launch_bounds(_WARPS, CONV_MIN_BLOCKS) "
        'if conv else ""',
        "header = _METAL_HEADER if metal else (launch_bounds(_WARPS, CONV_MIN_BLOCKS) "
        'if conv else "") + _BULK_HEADER',
    )
    text = sub(
        text,
        "_kernels: dict = {}",
        "_kernels: dict = {}\n_BULK_HEADER = r'''" + BULK_HEADER + "'''",
    )
    return text


if __name__ == "__main__":
    out = Path(sys.argv[1])
    src = Path(sys.argv[2]) if len(sys.argv) > 2 else SRC
    out.mkdir(parents=True, exist_ok=True)
    for name in (
        "plain",
        "bulk",
        "bulkall",
        "lds4",
        "lds4gb",
        "vact",
        "lds4vact",
        "vact2",
        "lds4vact2",
        "cluster",
        "cluster4",
        "cluster2",
        "onebfly",
        *SPLICED,
    ):
        try:
            text = variant(name, src)
        except SystemExit as e:
            print(f"{name}: skipped, its splice does not apply to {src} ({e})")
            continue
        (out / f"gd_{name}.py").write_text(text)
        print(out / f"gd_{name}.py")
