/* Small C helpers compiled into ffi._llama beside the llama.cpp declarations (build_ffi.py).
 * They do per-token work that would cost tens of microseconds in Python or in a general
 * llama.cpp sampler chain, and keep a load's log and progress out of Python. Declared for cffi at
 * the end of ffi/llama.cdef.h. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The largest value of x[from..to) (to > from) and, in *at, the first index holding it. NaNs
 * are never picked, except that x[from] is the answer when nothing is larger than it. Blocks
 * of 64 are reduced in 8 independent lanes (vectorizable); only the block that holds the
 * winner is scanned again for its index. */
static float llama_trio_max_run(const float *x, int32_t from, int32_t to, int32_t *at)
{
    float best = x[from];
    int32_t block = from;
    int32_t i = from;
    for (; i + 64 <= to; i += 64) {
        float lane[8];
        for (int k = 0; k < 8; k++) {
            lane[k] = -INFINITY;
        }
        for (int j = 0; j < 64; j += 8) {
            for (int k = 0; k < 8; k++) {
                float v = x[i + j + k];
                lane[k] = v > lane[k] ? v : lane[k];
            }
        }
        float m = lane[0];
        for (int k = 1; k < 8; k++) {
            m = lane[k] > m ? lane[k] : m;
        }
        if (m > best) {
            best = m;
            block = i;
        }
    }
    int32_t tail = -1;
    for (; i < to; i++) {
        if (x[i] > best) {
            best = x[i];
            tail = i;
        }
    }
    *at = from;
    if (tail >= 0) {
        *at = tail;
    } else {
        int32_t end = block + 64 < to ? block + 64 : to;
        for (int32_t j = block; j < end; j++) {
            if (x[j] == best) {
                *at = j;
                break;
            }
        }
    }
    return best;
}

/* Greedy pick from one row of logits: the index of the largest value after biases, the first
 * such index on ties (what llama.cpp's greedy sampler picks). bias_tokens[0..n_bias) is sorted
 * ascending, without duplicates, every entry in [0, n); bias_values holds the matching biases.
 * Unlike llama_sampler_sample, nothing is copied: one pass over n floats. */
static int32_t llama_trio_greedy(const float *logits, int32_t n, const int32_t *bias_tokens,
                                 const float *bias_values, int32_t n_bias)
{
    int32_t best = -1;
    float best_value = 0.0f;
    int32_t from = 0;
    for (int32_t b = 0; b <= n_bias; b++) {
        int32_t to = b < n_bias ? bias_tokens[b] : n;
        if (to > from) {
            int32_t at;
            float value = llama_trio_max_run(logits, from, to, &at);
            if (best < 0 || value > best_value) {
                best = at;
                best_value = value;
            }
        }
        if (b < n_bias) {
            float value = logits[to] + bias_values[b];
            if (best < 0 || value > best_value) {
                best = to;
                best_value = value;
            }
            from = to + 1;
        }
    }
    return best < 0 ? 0 : best;
}

/* Constrained decoding: every logit whose token is not allowed becomes -INFINITY, so that any
 * sampler (the greedy pick above, or a llama.cpp chain) sees only allowed tokens. mask holds one
 * bit per token, bit (i % 32) of word (i / 32) for token i (llguidance's layout); whole words of
 * allowed tokens are skipped. */
static void llama_trio_apply_mask(float *logits, int32_t n, const uint32_t *mask)
{
    for (int32_t word = 0; word * 32 < n; word++) {
        uint32_t bits = mask[word];
        if (bits == 0xFFFFFFFFu) {
            continue;
        }
        int32_t base = word * 32;
        int32_t end = base + 32 < n ? base + 32 : n;
        for (int32_t i = base; i < end; i++) {
            if (!((bits >> (i - base)) & 1u)) {
                logits[i] = -INFINITY;
            }
        }
    }
}

/* Log-probabilities from one row of logits (a log-softmax; -INFINITY logits, masked tokens,
 * have probability 0): returns log p(token), and writes the k most likely tokens, most likely
 * first (the lower index first on ties), with their log-probabilities. k <= 32. */
static float llama_trio_logprobs(const float *logits, int32_t n, int32_t token, int32_t k, int32_t *top_tokens,
                                 float *top_logprobs)
{
    float max = -INFINITY;
    for (int32_t i = 0; i < n; i++) {
        max = logits[i] > max ? logits[i] : max;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        sum += expf(logits[i] - max);
    }
    float lse = max + (float)log(sum);
    float values[32];
    int32_t count = 0;
    k = k < 32 ? k : 32;
    for (int32_t i = 0; i < n && k > 0; i++) {
        float v = logits[i];
        if (count == k && !(v > values[k - 1])) {
            continue;
        }
        int32_t at = count < k ? count++ : k - 1;
        while (at > 0 && v > values[at - 1]) {
            values[at] = values[at - 1];
            top_tokens[at] = top_tokens[at - 1];
            at--;
        }
        values[at] = v;
        top_tokens[at] = i;
    }
    for (int32_t j = 0; j < count; j++) {
        top_logprobs[j] = values[j] - lse;
    }
    return logits[token] - lse;
}

/* Connect llama.cpp's RPC backend to the rpc-server at endpoint ("host:port") and register its
 * devices (once per endpoint and process), as llama.cpp's own --rpc does: through the RPC backend's registry entry, so this
 * compiles and links whether the build has RPC or not. NULL when the build has no RPC backend
 * or the server offers no device. llama.cpp aborts the process when the server cannot be
 * reached: the caller checks that first. */
typedef ggml_backend_reg_t (*llama_trio_rpc_add_server_fn)(const char *endpoint);

static ggml_backend_reg_t llama_trio_rpc_add_server(const char *endpoint)
{
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (rpc == NULL) {
        return NULL;
    }
    llama_trio_rpc_add_server_fn add =
        (llama_trio_rpc_add_server_fn)ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    if (add == NULL) {
        return NULL;
    }
    ggml_backend_reg_t reg = add(endpoint);
    if (reg == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < ggml_backend_reg_count(); i++) {
        if (ggml_backend_reg_get(i) == reg) {
            return reg; /* this endpoint is registered already */
        }
    }
    ggml_backend_register(reg);
    return reg;
}

/* The tokens of a vocabulary (n of them) that are end-of-generation tokens (attr_mask == 0) or
 * have an attribute in attr_mask, into out (room for n); their count. One C call for a pass
 * that would be one call per token from Python. */
static int32_t llama_trio_vocab_select(const struct llama_vocab *vocab, int32_t n, int32_t attr_mask, int32_t *out)
{
    int32_t count = 0;
    for (llama_token t = 0; t < n; t++) {
        int hit = attr_mask == 0 ? llama_vocab_is_eog(vocab, t) : (llama_vocab_get_attr(vocab, t) & attr_mask) != 0;
        if (hit) {
            out[count++] = t;
        }
    }
    return count;
}

/* llama.cpp's log lines and load progress, kept in C while a thread loads.
 *
 * A line handed to Python (the ``forward`` callback, ffi/_lib.py) takes the GIL. A model's load
 * logs about a thousand lines and reports progress once per tensor; beside a thread that runs
 * Python (the start's imports, the event loop) each of those waits for its turn. So a thread
 * that captures (llama_trio_log_capture(1)) keeps its lines in a buffer of its own, read in one
 * call at the end; each record is its level plus one (with 0x80 set when the piece was also
 * handed to Python as it came), the text, and a NUL. Warnings and errors (and their
 * continuation pieces) still go to Python at once, so that what explains a load that aborts or
 * hangs is logged; they are rare. Other threads' lines go to Python as they come. */
static ggml_log_callback llama_trio_log_forward;
static _Thread_local int llama_trio_log_capturing;
static _Thread_local int llama_trio_log_urgent; /* the line under way is a warning or an error */
static _Thread_local char *llama_trio_log_buf;
static _Thread_local size_t llama_trio_log_len;
static _Thread_local size_t llama_trio_log_cap;

static void llama_trio_log_cb(enum ggml_log_level level, const char *text, void *user_data)
{
    if (level != GGML_LOG_LEVEL_CONT) {
        llama_trio_log_urgent = level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR;
    }
    int forward = !llama_trio_log_capturing || llama_trio_log_urgent;
    if (forward && llama_trio_log_forward != NULL) {
        llama_trio_log_forward(level, text, user_data);
    }
    if (!llama_trio_log_capturing) {
        return;
    }
    size_t n = strlen(text);
    size_t need = llama_trio_log_len + n + 2;
    if (need > llama_trio_log_cap) {
        size_t cap = llama_trio_log_cap ? llama_trio_log_cap : 65536;
        while (cap < need) {
            cap *= 2;
        }
        char *buf = realloc(llama_trio_log_buf, cap);
        if (buf == NULL) {
            return; /* out of memory: the line is lost, never the process */
        }
        llama_trio_log_buf = buf;
        llama_trio_log_cap = cap;
    }
    llama_trio_log_buf[llama_trio_log_len++] = (char)((level + 1) | (forward ? 0x80 : 0));
    memcpy(llama_trio_log_buf + llama_trio_log_len, text, n + 1);
    llama_trio_log_len += n + 1;
}

/* Route llama.cpp's log through llama_trio_log_cb; lines not captured go to ``forward``. */
static void llama_trio_log_install(ggml_log_callback forward)
{
    llama_trio_log_forward = forward;
    llama_log_set(llama_trio_log_cb, NULL);
}

/* Start (on) or stop capturing this thread's lines. Starting empties the buffer. */
static void llama_trio_log_capture(int on)
{
    llama_trio_log_capturing = on;
    if (on) {
        llama_trio_log_len = 0;
    }
}

/* This thread's captured records (*out, valid until the next capture or release) and their size. */
static size_t llama_trio_log_captured(const char **out)
{
    *out = llama_trio_log_buf;
    return llama_trio_log_len;
}

/* Free this thread's buffer. */
static void llama_trio_log_release(void)
{
    free(llama_trio_log_buf);
    llama_trio_log_buf = NULL;
    llama_trio_log_len = 0;
    llama_trio_log_cap = 0;
}

/* Load progress, kept by llama.cpp's progress callback without Python: ``progress`` (0 to 1)
 * for anyone to read; ``aborted``, which stops the load at its next report; ``report`` (Python's),
 * called only when the progress enters a new quarter (0, 25, 50, 75, 100 %), not per tensor. */
struct llama_trio_progress {
    float progress;
    int32_t aborted;
    int32_t quarter; /* the last quarter reported; -1 before the first */
    llama_progress_callback report;
    void *report_data;
};

static bool llama_trio_progress_cb(float progress, void *user_data)
{
    struct llama_trio_progress *p = user_data;
    int32_t aborted;
    __atomic_store(&p->progress, &progress, __ATOMIC_RELAXED);
    int32_t quarter = (int32_t)(progress * 4.0f);
    if (quarter != p->quarter && p->report != NULL) {
        p->quarter = quarter;
        p->report(progress, p->report_data);
    }
    __atomic_load(&p->aborted, &aborted, __ATOMIC_RELAXED);
    return !aborted;
}

/* A context's interrupt flag, as llama.cpp's abort callback (``Context.interrupt``): the CPU
 * backend asks it between the nodes of a decode's graph, and a decode that sees it set stops
 * there (llama_decode returns 2). Set and cleared from Python in any thread. */
static bool llama_trio_flag_cb(void *data)
{
    int32_t set;
    __atomic_load((int32_t *)data, &set, __ATOMIC_RELAXED);
    return set != 0;
}

static void llama_trio_flag_store(int32_t *flag, int32_t value)
{
    __atomic_store(flag, &value, __ATOMIC_RELAXED);
}
