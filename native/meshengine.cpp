// meshengine: the C API of meshengine.h over the patched llama.cpp.
//
// Every entry point validates what it can before llama.cpp sees it, because
// llama.cpp asserts (aborts) on much of what it considers a programming error.

#include "meshengine.h"

#include "ggml-cpu.h"
#include "llama.h"

// chat: llama.cpp's common/chat and json-schema-to-grammar (the meshchat target)
#include "chat.h"
#include "common.h"
#include "json-schema-to-grammar.h"
#include "json.h"
#include "log.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <vector>

struct me_model {
    llama_model * model;
    const llama_vocab * vocab;
    llama_model_range_info range;
    std::string arch;
    ggml_backend_dev_t gpu;  // the one device its offloaded layers are on, or null
};

struct me_context {
    me_model * model;
    llama_context * ctx;
    me_context_params params;
    int32_t stage_width; // floats per residual row in and out
    int32_t n_vocab;
    bool has_input;
    bool has_output;
    // positions per row of a residual-only batch: an M-RoPE model reads that many, section-major
    int32_t n_pos_per_row;
    llama_batch batch;
    ggml_threadpool * threadpool;
};

struct me_sampler {
    llama_sampler * chain;
    std::vector<llama_token_data> candidates;
    const llama_vocab * vocab;
    // chat: the grammar that masks the logits before the chain (me_sampler_set_grammar); null: none
    llama_sampler * grammar;
    // The random draw is not the chain's: one llama_sampler_init_dist for a whole session makes token k's
    // draw depend on how many draws came before it in this process, so a tail that takes over a session
    // mid-answer (its history accepted, no draws made) drew other tokens than the unbroken answer (13 of
    // 240 seeded answers in a 60-minute soak). Each pick draws from its own generator seeded by (seed,
    // tokens accepted so far), which the history alone fixes. temperature <= 0: no draw.
    bool draws;
    uint32_t seed;
    uint64_t n_accepted;
};

namespace {

// The seed of pick number n (tokens accepted before it) of a session seeded with `seed`: splitmix64's
// finaliser over both, never LLAMA_DEFAULT_SEED (which llama_sampler_init_dist replaces by a random seed).
uint32_t pick_seed(uint32_t seed, uint64_t n) {
    uint64_t z = ((uint64_t) seed << 32 ^ n) + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    const uint32_t out = (uint32_t) (z ^ (z >> 31));
    return out == LLAMA_DEFAULT_SEED ? 0 : out;
}

// Runs the chain over `arr`, then the pick's own draw where the session samples at random.
void apply_chain(me_sampler * sampler, llama_token_data_array * arr) {
    llama_sampler_apply(sampler->chain, arr);
    if (sampler->draws) {
        llama_sampler * dist = llama_sampler_init_dist(pick_seed(sampler->seed, sampler->n_accepted));
        llama_sampler_apply(dist, arr);
        llama_sampler_free(dist);
    }
}

thread_local std::string g_last_error;
// llama.cpp reports load failures only through its log; the error lines
// logged on this thread since the call began explain its failure.
thread_local std::vector<std::string> g_log_errors;
int32_t g_log_level = 0;
std::once_flag g_init_once;

int32_t fail(int32_t code, const char * fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    g_last_error = buf;
    return code;
}

void log_callback(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::string line(text);
        while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) {
            line.pop_back();
        }
        if (!line.empty() && g_log_errors.size() < 16) {
            g_log_errors.push_back(line);
        }
    }
    const int32_t rank = level == GGML_LOG_LEVEL_ERROR ? 0
                       : level == GGML_LOG_LEVEL_WARN  ? 1
                       : level == GGML_LOG_LEVEL_INFO  ? 2
                       : 3;
    if (rank <= g_log_level && level != GGML_LOG_LEVEL_CONT) {
        fputs(text, stderr);
    }
}

// drops llama.cpp's "function_name: " prefix from a log line
std::string strip_function(const std::string & line) {
    const auto colon = line.find(": ");
    if (colon != std::string::npos && line.find(' ') > colon) {
        return line.substr(colon + 2);
    }
    return line;
}

// why the call failed, from the error lines llama.cpp and ggml logged meanwhile
std::string logged_reason() {
    if (g_log_errors.empty()) {
        return "llama.cpp gave no reason";
    }
    const std::string marker = "error loading model: ";
    std::string reason = strip_function(g_log_errors.front());
    for (const auto & line : g_log_errors) {
        const auto at = line.rfind(marker);
        if (at != std::string::npos) {
            reason = strip_function(line.substr(at + marker.size()));
            break;
        }
    }
    if (reason.rfind("failed to load model from", 0) == 0) {
        // the GGUF parser failed; its own line says where
        for (const auto & line : g_log_errors) {
            if (line.rfind("gguf_", 0) == 0) {
                return "invalid GGUF file: " + strip_function(line);
            }
        }
        return "invalid GGUF file: the header or metadata is truncated or corrupt";
    }
    return reason;
}

// ---- Devices (GPU detection) ---------------------------------------------------------------------

// ggml's Vulkan backend passes over a device whose Vulkan type is CPU (Mesa's lavapipe) unless
// GGML_VK_VISIBLE_DEVICES names it: MESHD_VULKAN_DEVICE=N names Vulkan device N (vulkaninfo's order)
// for it. ggml reads the variable once, when its backends register, so it is set before that; one
// set by hand wins. An index past the last device leaves the build without its Vulkan backend.
void show_cpu_vulkan_device() {
    const char * want = getenv("MESHD_VULKAN_DEVICE");
    if (want && *want && !getenv("GGML_VK_VISIBLE_DEVICES")) {
        setenv("GGML_VK_VISIBLE_DEVICES", want, 1);
    }
}

// ggml-vulkan and ggml-cuda pick a matrix product's kernel by its row count (patches 0015 and 0018):
// one kernel for every row count, as on the CPU, unless MESHD_STOCK_KERNELS=1 asks for ggml's own
// choice (what tools/bench_vulkan.py compares against). Their fused kernels are formed by shape too:
// with the matmuls fixed, an IQ4_NL model's batch of 16 still had rows 9-15 differ from their decode
// steps on lavapipe until fusion was off as well; ggml-cuda fuses its matrix-vector kernels for one
// row only. The CUDA switches are compile-checked only, not yet run on a GPU.
void batch_invariant_gpu_kernels() {
    const char * stock = getenv("MESHD_STOCK_KERNELS");
    if (!(stock && strcmp(stock, "1") == 0)) {
        setenv("GGML_VK_BATCH_INVARIANT", "1", 1);
        setenv("GGML_VK_DISABLE_FUSION", "1", 1);
        setenv("GGML_CUDA_BATCH_INVARIANT", "1", 1);
        setenv("GGML_CUDA_DISABLE_FUSION", "1", 1);
    }
}

// The first GPU-like device, the one a load offloads to: one device, not llama.cpp's default of
// splitting layers over every GPU, so a stage's numerics are one device's and its report names it.
ggml_backend_dev_t first_gpu() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const auto type = ggml_backend_dev_type(dev);
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            return dev;
        }
    }
    return nullptr;
}

void describe_device(ggml_backend_dev_t dev, me_device_info * out) {
    memset(out, 0, sizeof *out);
    if (!dev) {
        return;
    }
    snprintf(out->name, sizeof out->name, "%s", ggml_backend_dev_name(dev));
    snprintf(out->description, sizeof out->description, "%s", ggml_backend_dev_description(dev));
    snprintf(out->backend, sizeof out->backend, "%s", ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)));
    switch (ggml_backend_dev_type(dev)) {
        case GGML_BACKEND_DEVICE_TYPE_GPU:   out->type = ME_DEVICE_GPU; break;
        case GGML_BACKEND_DEVICE_TYPE_IGPU:  out->type = ME_DEVICE_IGPU; break;
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: out->type = ME_DEVICE_ACCEL; break;
        default:                             out->type = ME_DEVICE_CPU; break;
    }
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(dev, &free, &total);
    out->memory_free = free;
    out->memory_total = total;
}

// ---- end of devices ------------------------------------------------------------------------------

void ensure_init() {
    std::call_once(g_init_once, [] {
        // ggml-cpu takes K- and IQ-quant matmuls of 8 or more rows (also per MoE expert) to a
        // tiled kernel that sums in another order than the vec_dot of fewer rows: a Q6_K model's
        // logits moved by up to 0.26 with the batch, gemma3-270m Q4_K_M's by 2.5. With
        // native/patches/0016's switch the K-quants (Q2_K to Q6_K) take the tiled sums at every row
        // count (few rows through row kernels that sum the same way) and every other type vec_dot
        // at every row count: batch-invariant at the tiled kernel's prefill speed (tools/bench_kquant.py, a
        // 3B-wide Q4_K_M on one thread: vec_dot for every row count, the way before, prefilled at
        // 0.6-0.8 of stock llama.cpp, this at 0.97; a decode step costs about a tenth more CPU than
        // vec_dot's). Both are pinned: a volunteer must not compute other bytes than its
        // replicas. ggml reads them once, at its first matmul, so they are set before any model loads.
        setenv("GGML_CPU_TILED_MM", "1", 1);
        setenv("GGML_CPU_TILED_MM_BATCH_INVARIANT", "1", 1);
        show_cpu_vulkan_device();
        batch_invariant_gpu_kernels();
        llama_log_set(log_callback, nullptr);
        llama_backend_init();
    });
}

bool read_magic(const char * path, char magic[4], long * size) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        return false;
    }
    const size_t n = fread(magic, 1, 4, f);
    fseek(f, 0, SEEK_END);
    *size = ftell(f);
    fclose(f);
    if (n < 4) {
        memset(magic + n, 0, 4 - n);
    }
    return true;
}

}  // namespace

extern "C" {

uint32_t me_abi_version(void) {
    return ME_ABI_VERSION;
}

size_t me_struct_size(int32_t which) {
    switch (which) {
        case ME_STRUCT_MODEL_INFO:     return sizeof(me_model_info);
        case ME_STRUCT_CONTEXT_PARAMS: return sizeof(me_context_params);
        case ME_STRUCT_SAMPLER_PARAMS: return sizeof(me_sampler_params);
        case ME_STRUCT_CHAT_MESSAGE:   return sizeof(me_chat_message);
        case ME_STRUCT_DEVICE_INFO:    return sizeof(me_device_info);
        default:                       return 0;
    }
}

const char * me_last_error(void) {
    return g_last_error.c_str();
}

void me_init(int32_t log_level) {
    g_log_level = log_level;
    ensure_init();
}

int32_t me_model_load(const char * path, int32_t layer_begin, int32_t layer_end,
                      int32_t n_gpu_layers, me_model ** out) {
    ensure_init();
    if (!path || !out) {
        return fail(ME_ERR_INVALID_ARGUMENT, "path and out are required");
    }
    *out = nullptr;
    char magic[4];
    long size = 0;
    if (!read_magic(path, magic, &size)) {
        return fail(ME_ERR_LOAD, "cannot open model file '%s'", path);
    }
    if (size == 0) {
        return fail(ME_ERR_LOAD, "model file '%s' is empty", path);
    }
    if (memcmp(magic, "GGUF", 4) != 0) {
        return fail(ME_ERR_LOAD, "'%s' is not a GGUF file (bad magic)", path);
    }

    llama_model_params mp = llama_model_default_params();
    mp.layer_begin = layer_begin;
    mp.layer_end = layer_end;
    mp.n_gpu_layers = n_gpu_layers;
    // ggml-cpu repacks Q4_K weights (on AVX2) into a layout whose gemm kernel takes groups of 4
    // rows and whose gemv kernel takes the rest, and the two sum in other orders: every row of a
    // group of 4 differed from its decode step (gemma3-270m Q4_K_M's logits by up to 3.8). Weights
    // stay in plain CPU buffers, where every row count runs the same vec_dot.
    mp.use_extra_bufts = false;
    // Offloaded layers go to one device (first_gpu); none offloaded, the load sees no GPU at all, so
    // its context computes on the CPU alone, as the CPU-only build does.
    ggml_backend_dev_t gpu = n_gpu_layers != 0 ? first_gpu() : nullptr;
    ggml_backend_dev_t devices[2] = {gpu, nullptr};
    mp.devices = devices;

    g_log_errors.clear();
    llama_model * model = nullptr;
    try {
        model = llama_model_load_from_file(path, mp);
    } catch (const std::exception & e) {
        return fail(ME_ERR_LOAD, "loading '%s' failed: %s", path, e.what());
    }
    if (!model) {
        const std::string reason = logged_reason();
        const int32_t code = reason.find("does not support partial layer ranges") != std::string::npos
            ? ME_ERR_UNSUPPORTED
            : (reason.find("layer range") != std::string::npos ? ME_ERR_INVALID_ARGUMENT : ME_ERR_LOAD);
        return fail(code, "%s", reason.c_str());
    }

    auto * m = new (std::nothrow) me_model{model, llama_model_get_vocab(model), llama_model_get_range_info(model), "", gpu};
    if (!m) {
        llama_model_free(model);
        return fail(ME_ERR_INTERNAL, "out of memory");
    }
    char arch[64] = {0};
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch);
    m->arch = arch;
    *out = m;
    return ME_OK;
}

void me_model_free(me_model * model) {
    if (model) {
        llama_model_free(model->model);
        delete model;
    }
}

int32_t me_model_get_info(const me_model * model, me_model_info * out) {
    if (!model || !out) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model and out are required");
    }
    memset(out, 0, sizeof *out);
    out->layer_begin = model->range.layer_begin;
    out->layer_end = model->range.layer_end;
    out->n_layer = model->range.n_layer;
    out->has_input = model->range.has_input;
    out->has_output = model->range.has_output;
    out->n_embd = llama_model_n_embd(model->model);
    out->stage_width = model->range.n_embd_stage;
    out->gpu_layer_begin = model->range.gpu_layer_begin;
    out->gpu_layer_end = model->range.gpu_layer_end;
    out->gpu_output = model->range.gpu_output;
    out->n_bytes_gpu = model->range.n_bytes_gpu;
    out->needs_tokens = model->range.needs_tokens;
    out->n_vocab = llama_vocab_n_tokens(model->vocab);
    out->n_ctx_train = llama_model_n_ctx_train(model->model);
    out->n_tensors = model->range.n_tensors;
    out->n_bytes = model->range.n_bytes;
    snprintf(out->arch, sizeof out->arch, "%s", model->arch.c_str());
    return ME_OK;
}

int32_t me_context_new(me_model * model, const me_context_params * params, me_context ** out) {
    if (!model || !params || !out) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model, params and out are required");
    }
    *out = nullptr;
    if (params->n_ctx < 1 || params->n_seq_max < 1 || params->n_batch < 1 || params->n_threads < 1) {
        return fail(ME_ERR_INVALID_ARGUMENT, "n_ctx, n_seq_max, n_batch and n_threads must be positive");
    }
    if (params->n_seq_max > 256) {
        return fail(ME_ERR_INVALID_ARGUMENT, "n_seq_max %u exceeds 256", params->n_seq_max);
    }
    if (params->n_ctx % params->n_seq_max != 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "n_ctx %u is not a multiple of n_seq_max %u", params->n_ctx, params->n_seq_max);
    }
    const bool has_output = model->range.has_output;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = params->n_ctx;
    cp.n_batch = params->n_batch;
    cp.n_ubatch = params->n_batch;
    cp.n_seq_max = params->n_seq_max;
    cp.n_threads = params->n_threads;
    cp.n_threads_batch = params->n_threads;
    cp.no_perf = true;
    // Before the tail every row's raw residual is the product: embeddings without pooling.
    cp.embeddings = !has_output;
    cp.pooling_type = has_output ? LLAMA_POOLING_TYPE_UNSPECIFIED : LLAMA_POOLING_TYPE_NONE;
    // Each sequence keeps its own cells, laid out as if it ran alone, so a session's
    // results do not depend on which other sessions share the context (a shared
    // pool fragments, and attention then sums in another order).
    cp.kv_unified = false;
    // ggml-cpu's flash attention picks its kernel by shape: a tiled f32 one for 64 or more query
    // rows, a split-KV one for a single row over 512 or more cells, else the f16 row kernel. Each
    // sums in its own order, so a position's logits would depend on its batch, and a failover's
    // one-batch re-prefill or a verified draft would part from the tokens decoded one by one.
    // The unfused attention runs the same kernels on every row count.
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    // With a GPU in the context and weights in host memory, ggml's scheduler moves an op of a large
    // batch (32 rows or more) to the GPU: a row would then be computed by the GPU's kernels in a
    // prefill and by the CPU's in a decode step (on lavapipe 9 of the 12 batch-invariance tests
    // failed with layers on the CPU). A layer computes where its weights are, whatever the batch.
    cp.op_offload = false;

    g_log_errors.clear();
    llama_context * ctx = nullptr;
    try {
        ctx = llama_init_from_model(model->model, cp);
    } catch (const std::exception & e) {
        return fail(ME_ERR_INTERNAL, "context creation failed: %s", e.what());
    }
    if (!ctx) {
        return fail(ME_ERR_INTERNAL, "context creation failed: %s", logged_reason().c_str());
    }
    ggml_threadpool * threadpool = nullptr;
    if (params->poll >= 0) {
        ggml_threadpool_params tpp = ggml_threadpool_params_default(params->n_threads);
        tpp.poll = (uint32_t) std::min(params->poll, 100);
        threadpool = ggml_threadpool_new(&tpp);
        if (!threadpool) {
            llama_free(ctx);
            return fail(ME_ERR_INTERNAL, "cannot create a thread pool of %d threads", params->n_threads);
        }
        llama_attach_threadpool(ctx, threadpool, threadpool);
    }
    // the rows that cross a stage boundary, in and out
    const int32_t stage_width = model->range.n_embd_stage;
    auto * c = new (std::nothrow) me_context{model, ctx, *params, stage_width,
                                             llama_vocab_n_tokens(model->vocab),
                                             (bool) model->range.has_input, has_output, 1, {}, threadpool};
    if (!c) {
        llama_free(ctx);
        if (threadpool) {
            ggml_threadpool_free(threadpool);
        }
        return fail(ME_ERR_INTERNAL, "out of memory");
    }
    c->batch = llama_batch_init((int32_t) params->n_batch, c->has_input ? 0 : stage_width, 1);
    const llama_rope_type rope = llama_model_rope_type(model->model);
    if (!c->has_input && !model->range.needs_tokens && (rope == LLAMA_ROPE_TYPE_MROPE || rope == LLAMA_ROPE_TYPE_IMROPE)) {
        // a batch of embeddings alone carries every M-RoPE section of every row (llama.cpp reads them as an
        // image's); the rows here are text, so they get what llama.cpp gives a text token at the head
        c->n_pos_per_row = GGML_MROPE_SECTIONS;
        free(c->batch.pos);
        c->batch.pos = (llama_pos *) malloc(sizeof(llama_pos) * params->n_batch * GGML_MROPE_SECTIONS);
        if (!c->batch.pos) {
            me_context_free(c);
            return fail(ME_ERR_INTERNAL, "out of memory");
        }
    }
    if (model->range.needs_tokens) {
        // an embedding batch has no token array; llama_batch_free frees this one with the rest
        c->batch.token = (llama_token *) malloc(sizeof(llama_token) * params->n_batch);
        if (!c->batch.token) {
            me_context_free(c);
            return fail(ME_ERR_INTERNAL, "out of memory");
        }
    }
    *out = c;
    return ME_OK;
}

void me_context_free(me_context * ctx) {
    if (ctx) {
        llama_batch_free(ctx->batch);
        llama_free(ctx->ctx);
        if (ctx->threadpool) {
            ggml_threadpool_free(ctx->threadpool);
        }
        delete ctx;
    }
}

int32_t me_forward(me_context * ctx, int32_t n_tokens,
                   const int32_t * tokens, const float * embd,
                   const int32_t * pos, const int32_t * seq_ids, const int8_t * want_output,
                   float * out, size_t out_capacity, int32_t * out_rows) {
    if (!ctx || !pos || !seq_ids || !out_rows) {
        return fail(ME_ERR_INVALID_ARGUMENT, "ctx, pos, seq_ids and out_rows are required");
    }
    *out_rows = 0;
    if (n_tokens < 1 || (uint32_t) n_tokens > ctx->params.n_batch) {
        return fail(ME_ERR_INVALID_ARGUMENT, "n_tokens %d outside [1, %u]", n_tokens, ctx->params.n_batch);
    }
    if (ctx->has_input && !tokens) {
        return fail(ME_ERR_INVALID_ARGUMENT, "this stage owns the embeddings: it takes token ids");
    }
    if (!ctx->has_input && !embd) {
        return fail(ME_ERR_INVALID_ARGUMENT, "this stage starts after layer 0: it takes residual rows");
    }
    if (ctx->has_input && embd) {
        return fail(ME_ERR_INVALID_ARGUMENT, "give token ids or residual rows, not both");
    }
    const bool needs_tokens = ctx->model->range.needs_tokens;
    if (needs_tokens && !tokens) {
        return fail(ME_ERR_INVALID_ARGUMENT, "this stage routes experts by token id: it takes the token ids too");
    }
    if (!ctx->has_input && !needs_tokens && tokens) {
        return fail(ME_ERR_INVALID_ARGUMENT, "this stage has no token embeddings: it cannot take token ids");
    }
    int32_t rows = 0;
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (tokens && (tokens[i] < 0 || tokens[i] >= ctx->n_vocab)) {
            return fail(ME_ERR_INVALID_ARGUMENT, "token id %d at row %d is outside the vocabulary [0, %d)",
                        tokens[i], i, ctx->n_vocab);
        }
        if (seq_ids[i] < 0 || (uint32_t) seq_ids[i] >= ctx->params.n_seq_max) {
            return fail(ME_ERR_INVALID_ARGUMENT, "sequence id %d at row %d is outside [0, %u)",
                        seq_ids[i], i, ctx->params.n_seq_max);
        }
        const uint32_t n_ctx_seq = ctx->params.n_ctx / ctx->params.n_seq_max;
        if (pos[i] < 0 || (uint32_t) pos[i] >= n_ctx_seq) {
            return fail(ME_ERR_INVALID_ARGUMENT, "position %d at row %d is outside [0, %u)",
                        pos[i], i, n_ctx_seq);
        }
        if (!ctx->has_output || (want_output && want_output[i])) {
            rows++;
        }
    }
    const int32_t width = ctx->has_output ? ctx->n_vocab : ctx->stage_width;
    const size_t need = (size_t) rows * (size_t) width;
    if (!out || out_capacity < need) {
        *out_rows = rows;
        return fail(ME_ERR_BUFFER_TOO_SMALL, "output needs %zu floats, capacity is %zu", need, out ? out_capacity : 0);
    }

    llama_batch & b = ctx->batch;
    b.n_tokens = n_tokens;
    if (tokens) {
        memcpy(b.token, tokens, sizeof(int32_t) * n_tokens);
    }
    if (embd) {
        memcpy(b.embd, embd, sizeof(float) * (size_t) n_tokens * ctx->stage_width);
    }
    for (int32_t i = 0; i < n_tokens; ++i) {
        b.pos[i] = pos[i];
        // a text row's M-RoPE sections: the position three times, then 0
        for (int32_t j = 1; j < ctx->n_pos_per_row; ++j) {
            b.pos[j * n_tokens + i] = j < ctx->n_pos_per_row - 1 ? pos[i] : 0;
        }
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = seq_ids[i];
        b.logits[i] = !ctx->has_output || (want_output && want_output[i]);
    }

    g_log_errors.clear();
    int32_t rc;
    try {
        rc = llama_decode(ctx->ctx, b);
    } catch (const std::exception & e) {
        return fail(ME_ERR_INTERNAL, "decode failed: %s", e.what());
    }
    if (rc == 1) {
        return fail(ME_ERR_NO_KV_SPACE, "no KV cache space for %d tokens", n_tokens);
    }
    if (rc != 0) {
        return fail(ME_ERR_COMPUTE, "decode failed (%d): %s", rc, logged_reason().c_str());
    }

    int32_t row = 0;
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (!b.logits[i]) {
            continue;
        }
        const float * src = ctx->has_output ? llama_get_logits_ith(ctx->ctx, i) : llama_get_embeddings_ith(ctx->ctx, i);
        if (!src) {
            return fail(ME_ERR_INTERNAL, "no output for row %d", i);
        }
        memcpy(out + (size_t) row * width, src, sizeof(float) * width);
        row++;
    }
    *out_rows = row;
    return ME_OK;
}

int32_t me_seq_remove(me_context * ctx, int32_t seq_id, int32_t p0, int32_t p1) {
    if (!ctx) {
        return fail(ME_ERR_INVALID_ARGUMENT, "ctx is required");
    }
    if (seq_id >= (int32_t) ctx->params.n_seq_max) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sequence id %d is outside [0, %u)", seq_id, ctx->params.n_seq_max);
    }
    // one sequence at a time: a recurrent memory takes no "every sequence" id
    const int32_t first = seq_id < 0 ? 0 : seq_id;
    const int32_t last = seq_id < 0 ? (int32_t) ctx->params.n_seq_max - 1 : seq_id;
    for (int32_t s = first; s <= last; ++s) {
        if (!llama_memory_seq_rm(llama_get_memory(ctx->ctx), s, p0, p1)) {
            return fail(ME_ERR_COMPUTE, "cannot remove positions [%d, %d) of sequence %d", p0, p1, s);
        }
    }
    return ME_OK;
}

int32_t me_seq_pos_max(me_context * ctx, int32_t seq_id, int32_t * out) {
    if (!ctx || !out) {
        return fail(ME_ERR_INVALID_ARGUMENT, "ctx and out are required");
    }
    if (seq_id < 0 || seq_id >= (int32_t) ctx->params.n_seq_max) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sequence id %d is outside [0, %u)", seq_id, ctx->params.n_seq_max);
    }
    *out = llama_memory_seq_pos_max(llama_get_memory(ctx->ctx), seq_id);
    return ME_OK;
}

// ----- prefix cache (issue 31)

int32_t me_seq_copy(me_context * ctx, int32_t src, int32_t dst, int32_t n_pos) {
    if (!ctx) {
        return fail(ME_ERR_INVALID_ARGUMENT, "ctx is required");
    }
    const int32_t n_seq = (int32_t) ctx->params.n_seq_max;
    if (src < 0 || src >= n_seq || dst < 0 || dst >= n_seq || src == dst) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sequences %d and %d must be two of [0, %d)", src, dst, n_seq);
    }
    if (n_pos < 0 || (uint32_t) n_pos > ctx->params.n_ctx / ctx->params.n_seq_max) {
        return fail(ME_ERR_INVALID_ARGUMENT, "%d positions exceed a sequence's %u", n_pos,
                    ctx->params.n_ctx / ctx->params.n_seq_max);
    }
    const llama_model * model = ctx->model->model;
    if (llama_model_n_swa(model) > 0 || llama_model_is_recurrent(model) || llama_model_is_hybrid(model)) {
        return fail(ME_ERR_UNSUPPORTED, "a prefix of this model's memory is not its cells alone");
    }
    llama_memory_t mem = llama_get_memory(ctx->ctx);
    int32_t held = llama_memory_seq_pos_max(mem, src) + 1;
    if (n_pos > held) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sequence %d holds %d positions, not %d", src, held, n_pos);
    }
    // each sequence is a stream of its own (kv_unified off): llama.cpp copies a whole stream's
    // buffers, so the copy is whole and the positions past the prefix are dropped after it
    if (!llama_memory_seq_rm(mem, dst, -1, -1)) {
        return fail(ME_ERR_COMPUTE, "cannot clear sequence %d", dst);
    }
    if (n_pos == 0) {
        return ME_OK;
    }
    llama_memory_seq_cp(mem, src, dst, -1, -1);
    if (!llama_memory_seq_rm(mem, dst, n_pos, -1)) {
        return fail(ME_ERR_COMPUTE, "cannot drop positions from %d of sequence %d", n_pos, dst);
    }
    return ME_OK;
}

int32_t me_tokenize(const me_model * model, const char * text, int32_t text_len,
                    int32_t add_special, int32_t parse_special,
                    int32_t * tokens, int32_t capacity, int32_t * n_tokens) {
    if (!model || !text || !n_tokens || text_len < 0 || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model, text and n_tokens are required; lengths are non-negative");
    }
    const int32_t n = llama_tokenize(model->vocab, text, text_len, tokens, tokens ? capacity : 0,
                                     add_special != 0, parse_special != 0);
    if (n == INT32_MIN) {
        return fail(ME_ERR_INVALID_ARGUMENT, "text too long to tokenize");
    }
    if (n < 0) {
        *n_tokens = -n;
        return fail(ME_ERR_BUFFER_TOO_SMALL, "tokenize needs %d tokens of room", -n);
    }
    *n_tokens = n;
    return ME_OK;
}

int32_t me_detokenize(const me_model * model, const int32_t * tokens, int32_t n_tokens,
                      int32_t remove_special, int32_t unparse_special,
                      char * buf, int32_t capacity, int32_t * n_bytes) {
    if (!model || (!tokens && n_tokens > 0) || !n_bytes || n_tokens < 0 || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model, tokens and n_bytes are required");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(model->vocab);
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return fail(ME_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary [0, %d)", tokens[i], n_vocab);
        }
    }
    const int32_t n = llama_detokenize(model->vocab, tokens, n_tokens, buf, buf ? capacity : 0,
                                       remove_special != 0, unparse_special != 0);
    if (n < 0) {
        *n_bytes = -n;
        return fail(ME_ERR_BUFFER_TOO_SMALL, "detokenize needs %d bytes", -n);
    }
    *n_bytes = n;
    return ME_OK;
}

int32_t me_token_piece(const me_model * model, int32_t token, int32_t special,
                       char * buf, int32_t capacity, int32_t * n_bytes) {
    if (!model || !n_bytes || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model and n_bytes are required");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(model->vocab);
    if (token < 0 || token >= n_vocab) {
        return fail(ME_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary [0, %d)", token, n_vocab);
    }
    const int32_t n = llama_token_to_piece(model->vocab, token, buf, buf ? capacity : 0, 0, special != 0);
    if (n < 0) {
        *n_bytes = -n;
        return fail(ME_ERR_BUFFER_TOO_SMALL, "piece needs %d bytes", -n);
    }
    *n_bytes = n;
    return ME_OK;
}

int32_t me_token_is_eog(const me_model * model, int32_t token) {
    if (!model || token < 0 || token >= llama_vocab_n_tokens(model->vocab)) {
        return 0;
    }
    return llama_vocab_is_eog(model->vocab, token) ? 1 : 0;
}

int32_t me_token_bos(const me_model * model) {
    return model ? llama_vocab_bos(model->vocab) : -1;
}

int32_t me_chat_apply(const me_model * model, const me_chat_message * messages, int32_t n_messages,
                      int32_t add_assistant, char * buf, int32_t capacity, int32_t * n_bytes) {
    if (!model || (!messages && n_messages > 0) || n_messages < 0 || !n_bytes || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model, messages and n_bytes are required");
    }
    std::vector<llama_chat_message> chat(n_messages);
    for (int32_t i = 0; i < n_messages; ++i) {
        if (!messages[i].role || !messages[i].content) {
            return fail(ME_ERR_INVALID_ARGUMENT, "message %d lacks a role or content", i);
        }
        chat[i] = {messages[i].role, messages[i].content};
    }
    const char * tmpl = llama_model_chat_template(model->model, nullptr);
    if (!tmpl) {
        return fail(ME_ERR_UNSUPPORTED, "the model has no chat template");
    }
    const int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant != 0,
                                                buf, buf ? capacity : 0);
    if (n < 0) {
        return fail(ME_ERR_UNSUPPORTED, "the model's chat template is not supported by llama.cpp");
    }
    *n_bytes = n;
    if (!buf || n > capacity) {
        return fail(ME_ERR_BUFFER_TOO_SMALL, "chat needs %d bytes", n);
    }
    return ME_OK;
}

int32_t me_sampler_new(const me_model * model, const me_sampler_params * p, me_sampler ** out) {
    if (!model || !p || !out) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model, params and out are required");
    }
    *out = nullptr;
    if (!(p->temperature == p->temperature) || !(p->top_p == p->top_p) || !(p->min_p == p->min_p) ||
        !(p->repeat_penalty == p->repeat_penalty)) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sampler parameters must not be NaN");
    }
    if (p->top_p <= 0.0f || p->min_p < 0.0f || p->min_p > 1.0f || p->repeat_penalty <= 0.0f || p->repeat_last_n < -1) {
        return fail(ME_ERR_INVALID_ARGUMENT,
                    "need top_p > 0, 0 <= min_p <= 1, repeat_penalty > 0, repeat_last_n >= -1");
    }
    llama_sampler_chain_params cp = llama_sampler_chain_default_params();
    cp.no_perf = true;
    llama_sampler * chain = llama_sampler_chain_init(cp);
    if (p->repeat_penalty != 1.0f) {
        llama_sampler_chain_add(chain, llama_sampler_init_penalties(llama_vocab_n_tokens(model->vocab), p->repeat_last_n, p->repeat_penalty, 0.0f, 0.0f));
    }
    if (p->temperature <= 0.0f) {
        llama_sampler_chain_add(chain, llama_sampler_init_greedy());
    } else {
        if (p->top_k > 0) {
            llama_sampler_chain_add(chain, llama_sampler_init_top_k(p->top_k));
        }
        if (p->top_p < 1.0f) {
            llama_sampler_chain_add(chain, llama_sampler_init_top_p(p->top_p, 1));
        }
        if (p->min_p > 0.0f) {
            llama_sampler_chain_add(chain, llama_sampler_init_min_p(p->min_p, 1));
        }
        llama_sampler_chain_add(chain, llama_sampler_init_temp(p->temperature));
    }
    auto * s = new (std::nothrow) me_sampler{chain, {}, model->vocab, nullptr, p->temperature > 0.0f, p->seed, 0};
    if (!s) {
        llama_sampler_free(chain);
        return fail(ME_ERR_INTERNAL, "out of memory");
    }
    s->candidates.resize(llama_vocab_n_tokens(model->vocab));
    *out = s;
    return ME_OK;
}

void me_sampler_free(me_sampler * sampler) {
    if (sampler) {
        llama_sampler_free(sampler->chain);
        if (sampler->grammar) {
            llama_sampler_free(sampler->grammar);
        }
        delete sampler;
    }
}

int32_t me_sampler_sample(me_sampler * sampler, const float * logits, int32_t n_vocab, int32_t * token) {
    if (!sampler || !logits || !token) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sampler, logits and token are required");
    }
    if (n_vocab != (int32_t) sampler->candidates.size()) {
        return fail(ME_ERR_INVALID_ARGUMENT, "logits have %d entries, the vocabulary %zu", n_vocab, sampler->candidates.size());
    }
    for (int32_t i = 0; i < n_vocab; ++i) {
        sampler->candidates[i] = llama_token_data{i, logits[i], 0.0f};
    }
    llama_token_data_array arr = {sampler->candidates.data(), sampler->candidates.size(), -1, false};
    try {
        apply_chain(sampler, &arr);
        if (arr.selected < 0 || (size_t) arr.selected >= arr.size) {
            return fail(ME_ERR_COMPUTE, "the sampler chain selected no token");
        }
        *token = arr.data[arr.selected].id;
        if (sampler->grammar) {
            // As llama.cpp's common_sampler: the chain's pick is checked against the grammar alone, and
            // only a refused pick is drawn again from the whole row with the grammar's mask applied
            // first. Masking the whole vocabulary on every step cost 0.3 to 1 s a token here (49k
            // pieces against the grammar's stacks); the check costs one piece. Either way the pick
            // depends only on the logits, the tokens so far and the seed: the same on every route.
            llama_token_data one = {*token, 1.0f, 0.0f};
            llama_token_data_array single = {&one, 1, -1, false};
            llama_sampler_apply(sampler->grammar, &single);
            if (one.logit == -INFINITY) {
                for (int32_t i = 0; i < n_vocab; ++i) {
                    sampler->candidates[i] = llama_token_data{i, logits[i], 0.0f};
                }
                arr = {sampler->candidates.data(), sampler->candidates.size(), -1, false};
                llama_sampler_apply(sampler->grammar, &arr);
                apply_chain(sampler, &arr);
                if (arr.selected < 0 || (size_t) arr.selected >= arr.size ||
                    arr.data[arr.selected].logit == -INFINITY) {
                    return fail(ME_ERR_COMPUTE, "the grammar allows no token here");
                }
                *token = arr.data[arr.selected].id;
            }
        }
        llama_sampler_accept(sampler->chain, *token);
        sampler->n_accepted += 1;
        if (sampler->grammar) {
            llama_sampler_accept(sampler->grammar, *token);
        }
    } catch (const std::exception & e) {
        return fail(ME_ERR_COMPUTE, "sampling failed: %s", e.what());
    }
    return ME_OK;
}

int32_t me_sampler_accept(me_sampler * sampler, int32_t token) {
    if (!sampler) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sampler is required");
    }
    if (token < 0 || token >= (int32_t) sampler->candidates.size()) {
        return fail(ME_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary", token);
    }
    llama_sampler_accept(sampler->chain, token);
    sampler->n_accepted += 1;
    return ME_OK;
}

// ---- Devices (GPU detection) ---------------------------------------------------------------------

const char * me_gpu_backend(void) {
#if defined(GGML_USE_CUDA)
    return "CUDA";
#elif defined(GGML_USE_VULKAN)
    return "Vulkan";
#else
    return "";
#endif
}

int32_t me_devices(me_device_info * out, int32_t capacity, int32_t * n_devices) {
    ensure_init();
    if (!n_devices || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "n_devices is required and capacity must not be negative");
    }
    const size_t count = ggml_backend_dev_count();
    *n_devices = (int32_t) count;
    if (!out) {
        return ME_OK;
    }
    if ((size_t) capacity < count) {
        return fail(ME_ERR_BUFFER_TOO_SMALL, "%zu devices, room for %d", count, capacity);
    }
    for (size_t i = 0; i < count; ++i) {
        describe_device(ggml_backend_dev_get(i), &out[i]);
    }
    return ME_OK;
}

int32_t me_model_device(const me_model * model, me_device_info * out) {
    if (!model || !out) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model and out are required");
    }
    describe_device(model->gpu, out);
    return ME_OK;
}

// ---- end of devices ------------------------------------------------------------------------------

}  // extern "C"

// --- chat: the model's own Jinja template, tool calls and grammars (llama.cpp's common/chat) ---

namespace {

std::once_flag g_chat_log_once;

// common/'s own log (LOG_WRN and friends) follows me_init's level: a template's warnings ("supports
// tool calls but does not natively describe tools") went to every asker's stderr.
void chat_log_init() {
    std::call_once(g_chat_log_once, [] {
        common_log_set_verbosity_thold(g_log_level < 0 ? -1 : g_log_level + 1);
    });
}

// Copies a result out by the query-size-then-fill idiom.
int32_t fill_out(const std::string & text, char * buf, int32_t capacity, int32_t * n_bytes, const char * what) {
    if (text.size() > (size_t) INT32_MAX) {
        return fail(ME_ERR_INTERNAL, "%s is too large", what);
    }
    *n_bytes = (int32_t) text.size();
    if (!buf || capacity < *n_bytes) {
        return fail(ME_ERR_BUFFER_TOO_SMALL, "%s needs %d bytes", what, *n_bytes);
    }
    std::memcpy(buf, text.data(), text.size());
    return ME_OK;
}

const char * trigger_type_name(common_grammar_trigger_type type) {
    switch (type) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN: return "token";
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD: return "word";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: return "pattern";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: return "pattern_full";
    }
    return "word";
}

std::string chat_render(const common_json & req) {
    const std::string tmpl = req.value("template", std::string());
    const std::string tool_use = req.value("tool_use_template", std::string());
    // common_chat_templates_init reads the tool-use variant only from a model: with a template string
    // alone it renders the default one, which is what a request without tools uses too
    const bool has_tools = req.contains("tools") && req.at("tools").is_array() && req.at("tools").size() > 0;
    const std::string & src = has_tools && !tool_use.empty() ? tool_use : tmpl;
    if (src.empty()) {
        throw std::invalid_argument("no chat template given");
    }
    auto tmpls = common_chat_templates_init(nullptr, src, req.value("bos_token", std::string()),
                                            req.value("eos_token", std::string()));
    common_chat_templates_inputs inputs;
    inputs.messages = common_chat_msgs_parse_oaicompat(req.at("messages"));
    if (has_tools) {
        inputs.tools = common_chat_tools_parse_oaicompat(req.at("tools"));
    }
    inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(req.value("tool_choice", std::string("auto")));
    inputs.parallel_tool_calls = req.value("parallel_tool_calls", false);
    inputs.add_generation_prompt = req.value("add_generation_prompt", true);
    inputs.enable_thinking = req.value("enable_thinking", true);
    inputs.reasoning_format = common_reasoning_format_from_name(req.value("reasoning_format", std::string("none")));
    if (req.contains("json_schema") && !req.at("json_schema").is_null()) {
        inputs.json_schema = req.at("json_schema").dump();
    }
    inputs.grammar = req.value("grammar", std::string());
    if (req.contains("chat_template_kwargs")) {
        for (const auto & [key, val] : req.at("chat_template_kwargs").items()) {
            inputs.chat_template_kwargs[key] = val.dump();
        }
    }
    if (req.contains("now")) {
        // the caller's render time (seconds since the epoch); the dates templates print (strftime_now,
        // datetime) still come from the clock, in llama.cpp's Jinja engine as in llama-server
        inputs.now = std::chrono::system_clock::time_point(std::chrono::seconds(req.value("now", (int64_t) 0)));
    }
    common_chat_params params = common_chat_templates_apply(tmpls.get(), inputs);
    std::string prompt = params.prompt;
    // as llama-server does: a BOS or EOS the tokenizer adds itself is not rendered twice
    const std::string bos = req.value("bos_token", std::string());
    const std::string eos = req.value("eos_token", std::string());
    if (req.value("add_bos", false) && !bos.empty() && prompt.compare(0, bos.size(), bos) == 0) {
        prompt = prompt.substr(bos.size());
    }
    if (req.value("add_eos", false) && !eos.empty() && prompt.size() >= eos.size() &&
        prompt.compare(prompt.size() - eos.size(), eos.size(), eos) == 0) {
        prompt = prompt.substr(0, prompt.size() - eos.size());
    }
    common_json out = common_json::object();
    out["prompt"] = prompt;
    out["format"] = (int) params.format;
    out["grammar"] = params.grammar;
    out["grammar_lazy"] = params.grammar_lazy;
    common_json triggers = common_json::array();
    for (const auto & t : params.grammar_triggers) {
        common_json jt = common_json::object();
        jt["type"] = trigger_type_name(t.type);
        jt["value"] = t.value;
        triggers.push_back(jt);
    }
    out["grammar_triggers"] = triggers;
    out["preserved_tokens"] = params.preserved_tokens;
    out["additional_stops"] = params.additional_stops;
    out["generation_prompt"] = params.generation_prompt;
    out["parser"] = params.parser;
    out["supports_thinking"] = params.supports_thinking;
    return out.dump();
}

std::string chat_parse(const common_json & spec, const std::string & text, bool partial) {
    common_chat_parser_params params;
    params.format = (common_chat_format) spec.value("format", (int) COMMON_CHAT_FORMAT_CONTENT_ONLY);
    if (params.format < 0 || params.format >= COMMON_CHAT_FORMAT_COUNT) {
        throw std::invalid_argument("unknown chat format");
    }
    params.generation_prompt = spec.value("generation_prompt", std::string());
    params.reasoning_format = common_reasoning_format_from_name(spec.value("reasoning_format", std::string("none")));
    const std::string parser = spec.value("parser", std::string());
    if (!parser.empty()) {
        params.parser.load(parser);
    }
    common_chat_msg msg = common_chat_parse(text, partial, params);
    common_json out = msg.to_json_oaicompat(/* concat_typed_text= */ true);
    if (!out.contains("content")) {
        out["content"] = nullptr;
    }
    return out.dump();
}

common_json parse_json_arg(const char * text, const char * what) {
    common_json j = common_json::parse_no_throw(text);
    if (j.is_discarded() || !j.is_object()) {
        throw std::invalid_argument(std::string(what) + " is not a JSON object");
    }
    return j;
}

}  // namespace

extern "C" {

int32_t me_model_chat_info(const me_model * model, char * buf, int32_t capacity, int32_t * n_bytes) {
    if (!model || !n_bytes || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "model and n_bytes are required");
    }
    try {
        const char * tmpl = llama_model_chat_template(model->model, nullptr);
        const char * tool_use = llama_model_chat_template(model->model, "tool_use");
        auto piece = [&](llama_token t) {
            return t == LLAMA_TOKEN_NULL ? std::string() : common_token_to_piece(model->vocab, t, true);
        };
        common_json out = common_json::object();
        out["template"] = tmpl ? tmpl : "";
        out["tool_use_template"] = tool_use ? tool_use : "";
        out["bos_token"] = piece(llama_vocab_bos(model->vocab));
        out["eos_token"] = piece(llama_vocab_eos(model->vocab));
        out["add_bos"] = llama_vocab_get_add_bos(model->vocab);
        out["add_eos"] = llama_vocab_get_add_eos(model->vocab);
        return fill_out(out.dump(), buf, capacity, n_bytes, "chat info");
    } catch (const std::exception & e) {
        return fail(ME_ERR_INTERNAL, "chat info: %s", e.what());
    }
}

int32_t me_chat_render(const char * request_json, char * buf, int32_t capacity, int32_t * n_bytes) {
    chat_log_init();
    if (!request_json || !n_bytes || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "request_json and n_bytes are required");
    }
    std::string out;
    try {
        out = chat_render(parse_json_arg(request_json, "the chat request"));
    } catch (const std::exception & e) {
        return fail(ME_ERR_INVALID_ARGUMENT, "chat template: %s", e.what());
    }
    return fill_out(out, buf, capacity, n_bytes, "the rendered chat");
}

int32_t me_chat_parse(const char * parser_json, const char * text, int32_t text_len, int32_t partial,
                      char * buf, int32_t capacity, int32_t * n_bytes) {
    chat_log_init();
    if (!parser_json || (!text && text_len > 0) || text_len < 0 || !n_bytes || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "parser_json, text and n_bytes are required");
    }
    std::string out;
    try {
        out = chat_parse(parse_json_arg(parser_json, "the parser"), std::string(text ? text : "", text_len),
                         partial != 0);
    } catch (const std::exception & e) {
        return fail(ME_ERR_INVALID_ARGUMENT, "chat parse: %s", e.what());
    }
    return fill_out(out, buf, capacity, n_bytes, "the parsed message");
}

int32_t me_json_schema_grammar(const char * schema_json, char * buf, int32_t capacity, int32_t * n_bytes) {
    chat_log_init();
    if (!schema_json || !n_bytes || capacity < 0) {
        return fail(ME_ERR_INVALID_ARGUMENT, "schema_json and n_bytes are required");
    }
    std::string out;
    try {
        common_json schema = common_json::parse_no_throw(schema_json);
        if (schema.is_discarded()) {
            throw std::invalid_argument("the schema is not JSON");
        }
        out = json_schema_to_grammar(schema);
    } catch (const std::exception & e) {
        return fail(ME_ERR_INVALID_ARGUMENT, "json schema: %s", e.what());
    }
    return fill_out(out, buf, capacity, n_bytes, "the grammar");
}

int32_t me_sampler_set_grammar(me_sampler * sampler, const char * spec_json) {
    chat_log_init();
    if (!sampler || !spec_json) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sampler and spec_json are required");
    }
    if (sampler->grammar) {
        return fail(ME_ERR_INVALID_ARGUMENT, "the sampler already has a grammar");
    }
    try {
        const common_json spec = parse_json_arg(spec_json, "the grammar spec");
        const std::string grammar = spec.value("gbnf", std::string());
        if (grammar.empty()) {
            return fail(ME_ERR_INVALID_ARGUMENT, "the grammar is empty");
        }
        auto tokens_of = [&](const std::string & text) { return common_tokenize(sampler->vocab, text, false, true); };
        // as llama-server does: a preserved token that is one token in this vocabulary, and a trigger
        // word that is such a token, trigger by id; other words and patterns by regex on the text
        std::set<llama_token> preserved;
        if (spec.contains("preserved_tokens")) {
            for (const auto & t : spec.at("preserved_tokens")) {
                auto ids = tokens_of(t.get<std::string>());
                if (ids.size() == 1) {
                    preserved.insert(ids[0]);
                }
            }
        }
        std::vector<std::string> patterns;
        std::vector<llama_token> trigger_tokens;
        if (spec.contains("triggers")) {
            for (const auto & t : spec.at("triggers")) {
                const std::string type = t.value("type", std::string());
                const std::string value = t.value("value", std::string());
                if (type == "word" || type == "token") {
                    auto ids = tokens_of(value);
                    if (ids.size() == 1 && (type == "token" || preserved.count(ids[0]))) {
                        trigger_tokens.push_back(ids[0]);
                    } else {
                        patterns.push_back(regex_escape(value));
                    }
                } else if (type == "pattern") {
                    patterns.push_back(value);
                } else if (type == "pattern_full") {
                    std::string anchored = "^$";
                    if (!value.empty()) {
                        anchored = (value.front() != '^' ? "^" : "") + value + (value.back() != '$' ? "$" : "");
                    }
                    patterns.push_back(anchored);
                } else {
                    return fail(ME_ERR_INVALID_ARGUMENT, "unknown grammar trigger type '%s'", type.c_str());
                }
            }
        }
        const bool lazy = spec.value("lazy", false);
        llama_sampler * g = nullptr;
        if (lazy) {
            if (patterns.empty() && trigger_tokens.empty()) {
                return fail(ME_ERR_INVALID_ARGUMENT, "a lazy grammar needs triggers");
            }
            std::vector<const char *> pc;
            for (const auto & p : patterns) {
                pc.push_back(p.c_str());
            }
            g = llama_sampler_init_grammar_lazy_patterns(sampler->vocab, grammar.c_str(), "root", pc.data(), pc.size(),
                                                         trigger_tokens.data(), trigger_tokens.size());
        } else {
            g = llama_sampler_init_grammar(sampler->vocab, grammar.c_str(), "root");
        }
        if (!g) {
            return fail(ME_ERR_INVALID_ARGUMENT, "the grammar does not parse");
        }
        const std::string gen = spec.value("generation_prompt", std::string());
        if (!lazy && spec.value("prefill", false) && !gen.empty()) {
            // what common_sampler_init does: the generation prompt the template already put in the
            // prompt advances the grammar (a space the tokenizer puts before it excepted)
            auto ids = tokens_of(gen);
            for (size_t i = 0; i < ids.size(); ++i) {
                const std::string piece = common_token_to_piece(sampler->vocab, ids[i], true);
                if (i == 0 && !piece.empty() && std::isspace((unsigned char) piece[0]) &&
                    !std::isspace((unsigned char) gen[0])) {
                    continue;
                }
                llama_sampler_accept(g, ids[i]);
            }
        }
        sampler->grammar = g;
    } catch (const std::exception & e) {
        return fail(ME_ERR_INVALID_ARGUMENT, "grammar: %s", e.what());
    }
    return ME_OK;
}

int32_t me_sampler_grammar_accept(me_sampler * sampler, int32_t token) {
    if (!sampler) {
        return fail(ME_ERR_INVALID_ARGUMENT, "sampler is required");
    }
    if (token < 0 || token >= (int32_t) sampler->candidates.size()) {
        return fail(ME_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary", token);
    }
    if (!sampler->grammar) {
        return ME_OK;
    }
    try {
        llama_sampler_accept(sampler->grammar, token);
    } catch (const std::exception & e) {
        return fail(ME_ERR_INVALID_ARGUMENT, "the grammar refuses token %d: %s", token, e.what());
    }
    return ME_OK;
}

}  // extern "C"
// --- end chat
