/* A recorded step's kernel calls, replayed in one call from Python (replay.py's StepGraph).
 *
 * Why in C: replaying a step call by call through ctypes cost ~1.5 us of argument
 * conversion per call and took the GIL back after every kernel. A SmolLM2 decode step makes
 * ~300 calls (a lone row: ~0.5 ms of a ~5 ms step), and in a server every kernel's return
 * waited for the GIL whenever the event loop held it. Here the whole step runs with the GIL
 * released and no conversion: each call is a kernel id, its arguments as 64-bit words (a
 * pointer, an integer or a float's value as a double) and, per argument, the step input whose
 * address is added to it (-1: none), as replay.py's patches did.
 *
 * Only the kernels a forward calls are here; a graph with any other runs call by call. The
 * argument kinds of each (pd_replay_kernel) let native.py check this table against its
 * ctypes signatures at load, so the two cannot drift apart unnoticed. */
#include "pd_kernels.h"

#define PD_REPLAY_ARGS 20

typedef union {
    int64_t i;
    double f;
} pd_word;

/* one recorded call; native.py's ReplayCall mirrors this layout */
typedef struct {
    int32_t kernel; /* index into KERNELS */
    int32_t check;  /* 1: the kernel returns an int that must equal rc */
    int64_t rc;
    pd_word args[PD_REPLAY_ARGS];
    int32_t patch[PD_REPLAY_ARGS]; /* -1, or the index of the step input whose address is added */
} pd_call;

/* name (without "pd_") and argument kinds: p pointer, i integer (int or int64_t), f float */
static const char *const KERNELS[][2] = {
    {"linear_packed", "ipiipppipi"},
    {"linear_packed_gemm", "ipiipppipi"},
    {"linear_lut4", "piipppiipi"},
    {"dequantize", "ipiip"},
    {"sgemm", "piiipippi"},
    {"moe_f32", "piippiippiip"},
    {"rms_norm", "ppppiif"},
    {"silu_mul", "ppii"},
    {"rope_neox", "piiiipp"},
    {"write_kv", "pipipppii"},
    {"paged_attention", "pipppipppipiiiifif"},
    {"gather_rows", "piipip"},
    {"argmax_rows", "piiip"},
    {"write_kv_bf16", "pipipppii"},
    {"paged_attention_bf16", "pipppipppipiiiifif"},
    {"amx_linear", "piiiipippii"},
    {"bf16dot_linear", "piiiipippii"},
    {"vnni_linear", "iipiiipipi"},
    {"gather_rows_bf16", "piipip"},
    {"amx_linear_silu", "piiiipippi"},
    {"bf16dot_linear_silu", "piiiipippi"},
    {"amx_qt_linear", "ipiiipipi"},
    {"amx_qt_linear_silu", "ipiiipipi"},
};
#define NUM_KERNELS ((int)(sizeof(KERNELS) / sizeof(KERNELS[0])))

/* The id of kernel `name` ("pd_" left off) in this table and its argument kinds (written
 * to `kinds`, which holds PD_REPLAY_ARGS + 1 chars), or -1 where it is not replayed here. */
int pd_replay_kernel(const char *name, char *kinds) {
    for (int k = 0; k < NUM_KERNELS; k++)
        if (strcmp(KERNELS[k][0], name) == 0) {
            strncpy(kinds, KERNELS[k][1], PD_REPLAY_ARGS);
            kinds[PD_REPLAY_ARGS] = '\0';
            return k;
        }
    return -1;
}

/* bytes of one pd_call, for native.py's check of its mirror */
int64_t pd_replay_call_size(void) { return (int64_t)sizeof(pd_call); }

/* Runs calls[0..n) with each patched argument's input base (bases[patch]) added. Returns -1
 * when every checked kernel returned its recorded value, else the index of the first that
 * did not (the calls after it are not run). */
int64_t pd_replay(const pd_call *calls, int64_t n, const int64_t *bases) {
    for (int64_t c = 0; c < n; c++) {
        const pd_call *call = calls + c;
        pd_word a[PD_REPLAY_ARGS];
        memcpy(a, call->args, sizeof(a));
        for (int j = 0; j < PD_REPLAY_ARGS; j++)
            if (call->patch[j] >= 0) a[j].i += bases[call->patch[j]];
#define P(j) ((void *)(intptr_t)a[j].i)
#define I(j) (a[j].i)
#define F(j) ((float)a[j].f)
        int64_t rc = 0;
        switch (call->kernel) {
        case 0: rc = pd_linear_packed(I(0), P(1), I(2), I(3), P(4), P(5), P(6), I(7), P(8), I(9)); break;
        case 1: rc = pd_linear_packed_gemm(I(0), P(1), I(2), I(3), P(4), P(5), P(6), I(7), P(8), I(9)); break;
        case 2: rc = pd_linear_lut4(P(0), I(1), I(2), P(3), P(4), P(5), I(6), I(7), P(8), I(9)); break;
        case 3: rc = pd_dequantize(I(0), P(1), I(2), I(3), P(4)); break;
        case 4: rc = pd_sgemm(P(0), I(1), I(2), I(3), P(4), I(5), P(6), P(7), I(8)); break;
        case 5: rc = pd_moe_f32(P(0), I(1), I(2), P(3), P(4), I(5), I(6), P(7), P(8), I(9), I(10), P(11)); break;
        case 6: pd_rms_norm(P(0), P(1), P(2), P(3), I(4), I(5), F(6)); break;
        case 7: pd_silu_mul(P(0), P(1), I(2), I(3)); break;
        case 8: pd_rope_neox(P(0), I(1), I(2), I(3), I(4), P(5), P(6)); break;
        case 9: pd_write_kv(P(0), I(1), P(2), I(3), P(4), P(5), P(6), I(7), I(8)); break;
        case 10:
            rc = pd_paged_attention(P(0), I(1), P(2), P(3), P(4), I(5), P(6), P(7), P(8), I(9), P(10), I(11), I(12),
                                    I(13), I(14), F(15), I(16), F(17));
            break;
        case 11: rc = pd_gather_rows(P(0), I(1), I(2), P(3), I(4), P(5)); break;
        case 12: pd_argmax_rows(P(0), I(1), I(2), I(3), P(4)); break;
        case 13: pd_write_kv_bf16(P(0), I(1), P(2), I(3), P(4), P(5), P(6), I(7), I(8)); break;
        case 14:
            rc = pd_paged_attention_bf16(P(0), I(1), P(2), P(3), P(4), I(5), P(6), P(7), P(8), I(9), P(10), I(11),
                                         I(12), I(13), I(14), F(15), I(16), F(17));
            break;
        case 15: rc = pd_amx_linear(P(0), I(1), I(2), I(3), I(4), P(5), I(6), P(7), P(8), I(9), I(10)); break;
        case 16: rc = pd_bf16dot_linear(P(0), I(1), I(2), I(3), I(4), P(5), I(6), P(7), P(8), I(9), I(10)); break;
        case 17: rc = pd_vnni_linear(I(0), I(1), P(2), I(3), I(4), I(5), P(6), I(7), P(8), I(9)); break;
        case 18: rc = pd_gather_rows_bf16(P(0), I(1), I(2), P(3), I(4), P(5)); break;
        case 19: rc = pd_amx_linear_silu(P(0), I(1), I(2), I(3), I(4), P(5), I(6), P(7), P(8), I(9)); break;
        case 20: rc = pd_bf16dot_linear_silu(P(0), I(1), I(2), I(3), I(4), P(5), I(6), P(7), P(8), I(9)); break;
        case 21: rc = pd_amx_qt_linear(I(0), P(1), I(2), I(3), I(4), P(5), I(6), P(7), I(8)); break;
        case 22: rc = pd_amx_qt_linear_silu(I(0), P(1), I(2), I(3), I(4), P(5), I(6), P(7), I(8)); break;
        default: return c;
        }
#undef P
#undef I
#undef F
        if (call->check && rc != call->rc) return c;
    }
    return -1;
}
