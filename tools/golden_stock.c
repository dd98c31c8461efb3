/* Greedy decoding and logits with STOCK llama.cpp (no meshd patch), for tools/make_goldens.py.
 *
 * It does exactly what meshd's LocalChain does through its own API, with the
 * same context settings, so the two can be compared bit for bit:
 *   one prefill batch (outputs on every row with --all-rows, else the last),
 *   then one single-token decode per step, greedy = first index of the maximum.
 *
 *   golden_stock MODEL N_CTX N_BATCH N_THREADS N_NEW ALL_ROWS LOGITS_OUT (--text TEXT | --tokens ID,ID,...)
 *
 * --text applies the model's chat template to one user message and tokenizes the
 * result (no added BOS, special tokens parsed), as meshd's tests do.
 * Prints one line: the prompt ids, a tab, the generated ids (comma separated).
 * LOGITS_OUT ("-" for none) receives float32 rows: the prefill's output rows,
 * then one row per generated token that was decoded afterwards.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static int fail(const char * what) {
    fprintf(stderr, "golden_stock: %s\n", what);
    return 1;
}

static int argmax(const float * row, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (row[i] > row[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char ** argv) {
    if (argc != 10) {
        return fail("usage: MODEL N_CTX N_BATCH N_THREADS N_NEW ALL_ROWS LOGITS_OUT --text TEXT|--tokens IDS");
    }
    const char * path = argv[1];
    const int n_ctx = atoi(argv[2]), n_batch = atoi(argv[3]), n_threads = atoi(argv[4]);
    const int n_new = atoi(argv[5]), all_rows = atoi(argv[6]);
    const char * logits_path = argv[7];

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) {
        return fail("cannot load the model");
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    /* meshd's context: n_ubatch = n_batch, one sequence, per-sequence KV, no perf counters */
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_batch;
    cp.n_ubatch = n_batch;
    cp.n_seq_max = 1;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.no_perf = 1;
    cp.kv_unified = 0;
    /* as libmeshengine: the batch-invariant kernels (no flash attention; see native/meshengine.cpp) */
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        return fail("cannot create a context");
    }

    int n_prompt = 0;
    llama_token * prompt = malloc(sizeof(llama_token) * (size_t) n_ctx);
    if (strcmp(argv[8], "--text") == 0) {
        const char * tmpl = llama_model_chat_template(model, NULL);
        struct llama_chat_message msg = {"user", argv[9]};
        const size_t cap = strlen(argv[9]) * 2 + 4096;
        char * text = malloc(cap);
        const int n = llama_chat_apply_template(tmpl, &msg, 1, 1, text, (int32_t) cap);
        if (!tmpl || n < 0 || (size_t) n >= cap) {
            return fail("cannot apply the chat template");
        }
        n_prompt = llama_tokenize(vocab, text, n, prompt, n_ctx, 0, 1);
        free(text);
    } else if (strcmp(argv[8], "--tokens") == 0) {
        for (char * s = strtok(argv[9], ","); s && n_prompt < n_ctx; s = strtok(NULL, ",")) {
            prompt[n_prompt++] = atoi(s);
        }
    } else {
        return fail("the prompt is --text TEXT or --tokens IDS");
    }
    if (n_prompt <= 0 || n_prompt > n_batch || n_prompt + n_new > n_ctx) {
        return fail("the prompt does not fit the batch or the context");
    }

    FILE * out = strcmp(logits_path, "-") == 0 ? NULL : fopen(logits_path, "wb");
    struct llama_batch batch = llama_batch_init(n_batch, 0, 1);
    for (int i = 0; i < n_prompt; i++) {
        batch.token[i] = prompt[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = all_rows || i == n_prompt - 1;
    }
    batch.n_tokens = n_prompt;
    if (llama_decode(ctx, batch) != 0) {
        return fail("prefill failed");
    }
    if (out) {
        for (int i = 0; i < n_prompt; i++) {
            if (batch.logits[i]) {
                fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t) n_vocab, out);
            }
        }
    }
    const float * last = llama_get_logits_ith(ctx, n_prompt - 1);

    for (int i = 0; i < n_prompt; i++) {
        printf(i ? ",%d" : "%d", prompt[i]);
    }
    printf("\t");
    for (int step = 0; step < n_new; step++) {
        const int token = argmax(last, n_vocab);
        printf(step ? ",%d" : "%d", token);
        if (llama_vocab_is_eog(vocab, token) || step == n_new - 1) {
            break;
        }
        batch.token[0] = token;
        batch.pos[0] = n_prompt + step;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
        if (llama_decode(ctx, batch) != 0) {
            return fail("decode failed");
        }
        last = llama_get_logits_ith(ctx, 0);
        if (out) {
            fwrite(last, sizeof(float), (size_t) n_vocab, out);
        }
    }
    printf("\n");
    if (out) {
        fclose(out);
    }
    llama_batch_free(batch);
    free(prompt);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
