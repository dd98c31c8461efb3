/* meshengine: a small C API over the range-aware llama.cpp of meshd.
 *
 * Opaque handles, plain structs, integer error codes. No llama.cpp type
 * crosses this header. Buffers follow the query-size-then-fill idiom: call
 * with a NULL (or too small) buffer to learn the size, then call again.
 * Every function checks its inputs and reports a code plus a message
 * (me_last_error) instead of aborting.
 *
 * This header is read verbatim by the Python binding (cffi cdef), so it
 * holds only declarations cffi understands: no preprocessor logic below the
 * guard other than the export macro, which the binding strips.
 */
#ifndef MESHENGINE_H
#define MESHENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef MESHENGINE_BUILD
#define ME_API __attribute__((visibility("default")))
#else
#define ME_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

#define ME_ABI_VERSION 5

enum me_status {
    ME_OK = 0,
    ME_ERR_INVALID_ARGUMENT = 1, /* a bad value from the caller; nothing changed */
    ME_ERR_LOAD = 2,             /* the model file could not be loaded */
    ME_ERR_UNSUPPORTED = 3,      /* e.g. a partial range of an architecture without range support */
    ME_ERR_NO_KV_SPACE = 4,      /* the KV cache has no room for the batch */
    ME_ERR_COMPUTE = 5,          /* llama.cpp refused or failed the batch */
    ME_ERR_BUFFER_TOO_SMALL = 6, /* the required size was written to the size output */
    ME_ERR_INTERNAL = 7
};

enum me_struct_id {
    ME_STRUCT_MODEL_INFO = 0,
    ME_STRUCT_CONTEXT_PARAMS = 1,
    ME_STRUCT_SAMPLER_PARAMS = 2,
    ME_STRUCT_CHAT_MESSAGE = 3,
    ME_STRUCT_DEVICE_INFO = 4
};

typedef struct me_model me_model;
typedef struct me_context me_context;
typedef struct me_sampler me_sampler;

/* What the loaded model holds, read from the loaded tensors, not from the request. */
typedef struct me_model_info {
    int32_t layer_begin;  /* first owned layer */
    int32_t layer_end;    /* one past the last owned layer */
    int32_t n_layer;      /* layers of the whole model */
    int32_t has_input;    /* owns token_embd: takes token ids */
    int32_t has_output;   /* owns the output head: produces logits */
    int32_t n_embd;       /* the model's hidden size */
    int32_t n_vocab;
    int32_t n_ctx_train;
    int64_t n_tensors;    /* distinct tensors loaded */
    uint64_t n_bytes;     /* bytes of the loaded tensors */
    char arch[32];        /* general.architecture */
    int32_t stage_width;  /* floats per token row between two stages: what a stage after the first takes
                             and one before the last puts out (n_embd for most architectures) */
    int32_t gpu_layer_begin; /* owned layers [gpu_layer_begin, gpu_layer_end) that n_gpu_layers offloads, */
    int32_t gpu_layer_end;   /* whether or not the build has a GPU (then n_bytes_gpu says what did) */
    int32_t gpu_output;      /* the output head is offloaded too */
    uint64_t n_bytes_gpu;    /* bytes of the loaded tensors in GPU memory */
    int32_t needs_tokens;    /* a stage after the first whose layers read token ids (DeepSeek V4's hash-routed
                                layers): me_forward takes the token ids with the residual rows */
} me_model_info;

typedef struct me_context_params {
    uint32_t n_ctx;       /* KV cells in all; each sequence owns n_ctx / n_seq_max of them */
    uint32_t n_seq_max;   /* sequence ids run from 0 to n_seq_max - 1 */
    uint32_t n_batch;     /* most tokens in one me_forward call */
    int32_t n_threads;
    int32_t poll;         /* how long idle compute threads spin before sleeping, 0..100; < 0: ggml's default.
                             Stages sharing cores want 0, so a waiting stage leaves the cores to the others. */
} me_context_params;

typedef struct me_sampler_params {
    float temperature;    /* <= 0: greedy */
    int32_t top_k;        /* <= 0: off */
    float top_p;          /* >= 1: off */
    float min_p;          /* <= 0: off */
    float repeat_penalty; /* 1: off */
    int32_t repeat_last_n;
    uint32_t seed;        /* a pick's draw depends on (seed, tokens accepted before it) alone */
} me_sampler_params;

typedef struct me_chat_message {
    const char * role;
    const char * content;
} me_chat_message;

ME_API uint32_t me_abi_version(void);
ME_API size_t me_struct_size(int32_t which);

/* Thread-local message of the last failing call on this thread. */
ME_API const char * me_last_error(void);

/* Once per process. level: -1 silent, 0 errors, 1 warnings, 2 info (llama.cpp log to stderr). */
ME_API void me_init(int32_t log_level);

/* Loads layers [layer_begin, layer_end) of a GGUF; layer_end < 0 means the last layer.
 * n_gpu_layers counts over the owned layers, from the end of the range (as llama.cpp counts over the
 * whole model); at the tail the output head is one more, the last. < 0: every owned layer and the head. */
ME_API int32_t me_model_load(const char * path, int32_t layer_begin, int32_t layer_end,
                             int32_t n_gpu_layers, me_model ** out);
ME_API void me_model_free(me_model * model);
ME_API int32_t me_model_get_info(const me_model * model, me_model_info * out);

ME_API int32_t me_context_new(me_model * model, const me_context_params * params, me_context ** out);
ME_API void me_context_free(me_context * ctx);

/* Runs n_tokens rows through the owned layers.
 * Input: token ids at a stage that owns the input, residual rows (n_tokens x stage_width f32) elsewhere,
 * and both at a stage whose needs_tokens is set.
 * Output: at a stage without the output head, the residual of every row (n_tokens x stage_width);
 * at the tail, logits (n_vocab floats) for each row whose want_output is non-zero, in row order.
 * out_capacity counts floats; *out_rows receives the number of output rows. */
ME_API int32_t me_forward(me_context * ctx, int32_t n_tokens,
                          const int32_t * tokens, const float * embd,
                          const int32_t * pos, const int32_t * seq_ids, const int8_t * want_output,
                          float * out, size_t out_capacity, int32_t * out_rows);

/* Drops positions [p0, p1) of a sequence (p1 < 0: to the end); seq_id < 0: every sequence. */
ME_API int32_t me_seq_remove(me_context * ctx, int32_t seq_id, int32_t p0, int32_t p1);
/* Largest position held for the sequence, -1 when empty. */
ME_API int32_t me_seq_pos_max(me_context * ctx, int32_t seq_id, int32_t * out);

/* Prefix cache: sequence dst is cleared and then holds positions [0, n_pos) of sequence src (the KV
 * cells, copied: src keeps its own). The copy is made before the next me_forward of the context.
 * ME_ERR_UNSUPPORTED where a prefix's cells are not the whole of its state: a sliding-window,
 * recurrent or hybrid memory, which forgets or folds the positions a prefix needs. */
ME_API int32_t me_seq_copy(me_context * ctx, int32_t src, int32_t dst, int32_t n_pos);

ME_API int32_t me_tokenize(const me_model * model, const char * text, int32_t text_len,
                           int32_t add_special, int32_t parse_special,
                           int32_t * tokens, int32_t capacity, int32_t * n_tokens);
ME_API int32_t me_detokenize(const me_model * model, const int32_t * tokens, int32_t n_tokens,
                             int32_t remove_special, int32_t unparse_special,
                             char * buf, int32_t capacity, int32_t * n_bytes);
/* Bytes of one token's piece (possibly part of a UTF-8 sequence). */
ME_API int32_t me_token_piece(const me_model * model, int32_t token, int32_t special,
                              char * buf, int32_t capacity, int32_t * n_bytes);
ME_API int32_t me_token_is_eog(const me_model * model, int32_t token);
ME_API int32_t me_token_bos(const me_model * model);

/* Formats messages with the model's own chat template. */
ME_API int32_t me_chat_apply(const me_model * model, const me_chat_message * messages, int32_t n_messages,
                             int32_t add_assistant, char * buf, int32_t capacity, int32_t * n_bytes);

ME_API int32_t me_sampler_new(const me_model * model, const me_sampler_params * params, me_sampler ** out);
ME_API void me_sampler_free(me_sampler * sampler);
/* Picks a token from one row of logits and records it in the sampler's history. */
ME_API int32_t me_sampler_sample(me_sampler * sampler, const float * logits, int32_t n_vocab, int32_t * token);
/* Records a token (e.g. of the prompt) in the history that the repetition penalty sees. */
ME_API int32_t me_sampler_accept(me_sampler * sampler, int32_t token);

/* ---- Devices (GPU detection): what this build can offload to ---------------------------------- */

enum me_device_type {
    ME_DEVICE_CPU = 0,
    ME_DEVICE_GPU = 1,
    ME_DEVICE_IGPU = 2,   /* integrated, sharing the host's memory */
    ME_DEVICE_ACCEL = 3
};

typedef struct me_device_info {
    char name[64];          /* ggml's name for it, e.g. "Vulkan0", "CUDA0", "CPU" */
    char description[128];  /* the driver's, e.g. "llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H100 80GB HBM3" */
    char backend[32];       /* the backend that drives it: "Vulkan", "CUDA", "CPU" */
    int32_t type;           /* enum me_device_type */
    uint64_t memory_free;   /* bytes, as the driver reports them now */
    uint64_t memory_total;
} me_device_info;

/* The GPU backend compiled into this library ("Vulkan", "CUDA"), or "" for a CPU-only build. */
ME_API const char * me_gpu_backend(void);
/* The devices this process sees, the CPU included. Query-size-then-fill: with out NULL or capacity
 * too small, *n_devices receives the count (ME_ERR_BUFFER_TOO_SMALL when out is not NULL). */
ME_API int32_t me_devices(me_device_info * out, int32_t capacity, int32_t * n_devices);
/* The device a model's offloaded layers live on; out->name is "" when nothing is offloaded. */
ME_API int32_t me_model_device(const me_model * model, me_device_info * out);
/* --- chat: the model's own Jinja template, tool calls and grammars (llama.cpp's common/chat) ---
 * Requests and results are JSON text (UTF-8): their shapes are llama-server's, so a template behaves
 * here as it does there. Rendering and parsing need no model: the template is a string. */

/* The model's chat template source (name NULL: the default one, else e.g. "tool_use"), and its BOS
 * and EOS pieces and whether the tokenizer adds them, as JSON {"template", "tool_use_template",
 * "bos_token", "eos_token", "add_bos", "add_eos"} ("" where the file has none). */
ME_API int32_t me_model_chat_info(const me_model * model, char * buf, int32_t capacity, int32_t * n_bytes);

/* Renders a chat request with a template, as llama-server does with --jinja.
 * request_json: {"template", "tool_use_template"?, "bos_token", "eos_token", "add_bos", "add_eos",
 *   "messages": [OpenAI chat messages], "tools"?: [OpenAI tools], "tool_choice"?: "auto"|"required"|"none",
 *   "parallel_tool_calls"?, "add_generation_prompt"?, "enable_thinking"?, "chat_template_kwargs"?: {},
 *   "json_schema"?: {}, "grammar"?: "GBNF", "reasoning_format"?: "none"|"auto"|"deepseek"|...}
 * Writes {"prompt", "format", "grammar", "grammar_lazy", "grammar_triggers": [{"type", "value"}],
 *   "preserved_tokens", "additional_stops", "generation_prompt", "parser", "supports_thinking"}.
 * A template that fails to render is ME_ERR_INVALID_ARGUMENT with the template engine's message. */
ME_API int32_t me_chat_render(const char * request_json, char * buf, int32_t capacity, int32_t * n_bytes);

/* Parses a model's output (text_len bytes; partial: more may follow) with what me_chat_render gave:
 * parser_json {"format", "parser", "generation_prompt", "reasoning_format"?}.
 * Writes the assistant message as OpenAI's JSON {"role", "content", "reasoning_content", "tool_calls"}. */
ME_API int32_t me_chat_parse(const char * parser_json, const char * text, int32_t text_len, int32_t partial,
                             char * buf, int32_t capacity, int32_t * n_bytes);

/* A JSON schema as a GBNF grammar (llama.cpp's json-schema-to-grammar). */
ME_API int32_t me_json_schema_grammar(const char * schema_json, char * buf, int32_t capacity, int32_t * n_bytes);

/* Constrains a sampler by a grammar, before its first sample: spec_json {"gbnf", "lazy",
 * "triggers": [{"type": "word"|"pattern"|"pattern_full"|"token", "value"}], "preserved_tokens": [...],
 * "generation_prompt", "prefill"} (prefill: the generation prompt's tokens are fed to the grammar first,
 * as llama.cpp does for tool-call and output-format grammars). The grammar masks the logits before the
 * rest of the chain, and sees only sampled tokens (me_sampler_grammar_accept), never the history. */
ME_API int32_t me_sampler_set_grammar(me_sampler * sampler, const char * spec_json);
/* Feeds a token generated earlier (a re-prefill after a failover) to the grammar alone. */
ME_API int32_t me_sampler_grammar_accept(me_sampler * sampler, int32_t token);
/* --- end chat */

/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif
