/* The part of llama.h (and ggml.h) that ffi/ calls, for cffi's out-of-line API mode.
 *
 * Structs we only pass around are opaque; parameter structs end in "...;" and enum values are
 * "= ...", so the C compiler checks every layout and value against the pinned header when
 * build_ffi.py compiles the extension. Add a declaration here only when Python calls it. */

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_vocab;
struct llama_model;
struct llama_context;
struct llama_sampler;
typedef struct llama_memory_i * llama_memory_t;

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE = ...,
    GGML_LOG_LEVEL_DEBUG = ...,
    GGML_LOG_LEVEL_INFO = ...,
    GGML_LOG_LEVEL_WARN = ...,
    GGML_LOG_LEVEL_ERROR = ...,
    GGML_LOG_LEVEL_CONT = ...,
};
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);
typedef bool (*llama_progress_callback)(float progress, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

/* ggml's backends and devices (ggml-backend.h); the RPC backend is reached through its
 * registry entry (ffi/helpers.h), so the binding builds with RPC on or off. */
typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU = ...,
    GGML_BACKEND_DEVICE_TYPE_GPU = ...,
    GGML_BACKEND_DEVICE_TYPE_IGPU = ...,
    GGML_BACKEND_DEVICE_TYPE_ACCEL = ...,
    ...
};
enum ggml_type {
    GGML_TYPE_F32 = ...,
    GGML_TYPE_F16 = ...,
    GGML_TYPE_BF16 = ...,
    GGML_TYPE_Q8_0 = ...,
    GGML_TYPE_Q4_0 = ...,
    GGML_TYPE_Q4_1 = ...,
    GGML_TYPE_Q5_0 = ...,
    GGML_TYPE_Q5_1 = ...,
    GGML_TYPE_IQ4_NL = ...,
    ...
};
enum llama_split_mode {
    LLAMA_SPLIT_MODE_NONE = ...,
    LLAMA_SPLIT_MODE_LAYER = ...,
    LLAMA_SPLIT_MODE_ROW = ...,
    ...
};
enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO = ...,
    LLAMA_FLASH_ATTN_TYPE_DISABLED = ...,
    LLAMA_FLASH_ATTN_TYPE_ENABLED = ...,
    ...
};

struct llama_model_params {
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    int32_t main_gpu;
    const float * tensor_split;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    bool vocab_only;
    bool check_tensors;
    ...;
};

enum llama_pooling_type {
    LLAMA_POOLING_TYPE_UNSPECIFIED = ...,
    LLAMA_POOLING_TYPE_NONE = ...,
    LLAMA_POOLING_TYPE_MEAN = ...,
    LLAMA_POOLING_TYPE_CLS = ...,
    LLAMA_POOLING_TYPE_LAST = ...,
    ...
};

struct llama_context_params {
    enum llama_pooling_type pooling_type;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    bool offload_kqv;
    bool embeddings;
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    ggml_abort_callback abort_callback;
    void *              abort_callback_data;
    bool no_perf;
    bool kv_unified;
    ...;
};

typedef struct llama_sampler_chain_params {
    bool no_perf;
    ...;
} llama_sampler_chain_params;

typedef struct llama_logit_bias {
    llama_token token;
    float bias;
} llama_logit_bias;

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;

/* process */
void llama_backend_init(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
size_t llama_max_parallel_sequences(void);
size_t llama_max_devices(void);
bool llama_supports_gpu_offload(void);
bool llama_supports_rpc(void);

size_t ggml_row_size(enum ggml_type type, int64_t ne);

/* backend devices */
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);

/* model */
struct llama_model_params llama_model_default_params(void);
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_n_swa(const struct llama_model * model);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);

/* vocab */
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
enum llama_token_attr { LLAMA_TOKEN_ATTR_UNKNOWN = ..., LLAMA_TOKEN_ATTR_CONTROL = ..., ... };
enum llama_token_attr llama_vocab_get_attr(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_pre(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_suf(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_mid(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_rep(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_sep(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);

/* context */
struct llama_context_params llama_context_default_params(void);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);
uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
llama_memory_t llama_get_memory(const struct llama_context * ctx);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_synchronize(struct llama_context * ctx);

/* memory (KV cells) */
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);

/* one sequence's state (its KV cells) to and from host memory */
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);

/* batch */
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);

/* sampling */
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                    float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                     const llama_logit_bias * logit_bias);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);
enum llama_pooling_type llama_pooling_type(const struct llama_context * ctx);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);

/* our helpers (ffi/helpers.h) */
int32_t llama_trio_greedy(const float * logits, int32_t n, const int32_t * bias_tokens,
                          const float * bias_values, int32_t n_bias);
void llama_trio_apply_mask(float * logits, int32_t n, const uint32_t * mask);
ggml_backend_reg_t llama_trio_rpc_add_server(const char * endpoint);
float llama_trio_logprobs(const float * logits, int32_t n, int32_t token, int32_t k, int32_t * top_tokens,
                          float * top_logprobs);
int32_t llama_trio_vocab_select(const struct llama_vocab * vocab, int32_t n, int32_t attr_mask, int32_t * out);
void llama_trio_log_install(ggml_log_callback forward);
void llama_trio_log_capture(int on);
size_t llama_trio_log_captured(const char ** out);
void llama_trio_log_release(void);
struct llama_trio_progress {
    float progress;
    int32_t aborted;
    int32_t quarter;
    llama_progress_callback report;
    void * report_data;
};
bool llama_trio_progress_cb(float progress, void * user_data);
bool llama_trio_flag_cb(void * data);
void llama_trio_flag_store(int32_t * flag, int32_t value);

/* callbacks implemented in Python (ffi/_lib.py) */
extern "Python" void _llama_trio_log(enum ggml_log_level, const char *, void *);
extern "Python" bool _llama_trio_progress(float, void *);
