// dump_logits: run a GGUF through llama.cpp (CPU) and print every position's logits as JSON.
//
// Each prompt is fed three ways on a fresh context state:
//   whole          one llama_decode with all tokens
//   chunked        one llama_decode per chunk (sizes given, must sum to the prompt length)
//   token_by_token one llama_decode per token
// and the logits of EVERY position are recorded (batch.logits[i] = 1 for all i).
//
// Usage: dump_logits MODEL.gguf SHA256 VERSION OUT.json PROMPT_SPEC [PROMPT_SPEC...]
//   PROMPT_SPEC = "id,id,id,...;c1,c2,c3"   (token ids; chunk sizes)
//
// Build (see scripts/k3/make-fixtures.sh):
//   g++ -O2 -std=c++17 dump_logits.cpp -I$LLAMA/include -I$LLAMA/ggml/include \
//       -L$BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,$BUILD/bin -o dump_logits

#include "llama.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

static std::vector<int> parse_ints(const std::string & s) {
    std::vector<int> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (!item.empty()) out.push_back(std::atoi(item.c_str()));
    }
    return out;
}

// runs `tokens` split into `chunks` on a cleared state; returns [n_tokens][n_vocab]
static std::vector<std::vector<float>> run(llama_context * ctx, int n_vocab,
                                           const std::vector<llama_token> & tokens,
                                           const std::vector<int> & chunks) {
    llama_memory_clear(llama_get_memory(ctx), true);
    std::vector<std::vector<float>> out;
    int pos = 0;
    for (int c : chunks) {
        llama_batch batch = llama_batch_init(c, 0, 1);
        for (int i = 0; i < c; ++i) {
            batch.token[i]     = tokens[pos + i];
            batch.pos[i]       = pos + i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = 1;
        }
        batch.n_tokens = c;
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed at pos %d\n", pos);
            std::exit(1);
        }
        for (int i = 0; i < c; ++i) {
            const float * l = llama_get_logits_ith(ctx, i);
            out.emplace_back(l, l + n_vocab);
        }
        llama_batch_free(batch);
        pos += c;
    }
    return out;
}

static void write_matrix(FILE * f, const std::vector<std::vector<float>> & m) {
    fprintf(f, "[\n");
    for (size_t r = 0; r < m.size(); ++r) {
        fprintf(f, "      [");
        for (size_t c = 0; c < m[r].size(); ++c) {
            fprintf(f, "%s%.9g", c ? "," : "", m[r][c]);
        }
        fprintf(f, "]%s\n", r + 1 < m.size() ? "," : "");
    }
    fprintf(f, "    ]");
}

static double max_abs_diff(const std::vector<std::vector<float>> & a, const std::vector<std::vector<float>> & b) {
    double d = 0;
    for (size_t r = 0; r < a.size(); ++r)
        for (size_t c = 0; c < a[r].size(); ++c) d = std::fmax(d, std::fabs((double) a[r][c] - b[r][c]));
    return d;
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MODEL.gguf SHA256 VERSION OUT.json 'ids;chunks' ['ids;chunks' ...]\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    const char * sha        = argv[2];
    const char * version    = argv[3];
    const char * out_path   = argv[4];

    if (!getenv("DUMP_VERBOSE")) llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = 64;
    cp.n_batch         = 64;
    cp.n_ubatch        = 64;
    cp.n_seq_max       = 1;
    cp.n_threads       = 1;
    cp.n_threads_batch = 1;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    // keep the MLA latent cache in f32 (the default f16 cache rounds K/V)
    cp.type_k          = GGML_TYPE_F32;
    cp.type_v          = GGML_TYPE_F32;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    FILE * f = fopen(out_path, "w");
    if (!f) { perror(out_path); return 1; }
    fprintf(f, "{\n  \"gguf_sha256\": \"%s\",\n  \"llama_cpp_version\": \"%s\",\n", sha, version);
    fprintf(f, "  \"settings\": {\"backend\": \"CPU\", \"n_threads\": 1, \"n_ctx\": 64, \"n_batch\": 64, \"n_ubatch\": 64, \"n_seq_max\": 1, \"flash_attn\": false, \"type_k\": \"f32\", \"type_v\": \"f32\"},\n");
    fprintf(f, "  \"n_vocab\": %d,\n  \"prompts\": [\n", n_vocab);

    for (int p = 5; p < argc; ++p) {
        std::string spec = argv[p];
        const size_t semi = spec.find(';');
        std::vector<int> ids    = parse_ints(spec.substr(0, semi));
        std::vector<int> chunks = parse_ints(spec.substr(semi + 1));
        int sum = 0;
        for (int c : chunks) sum += c;
        if (sum != (int) ids.size()) { fprintf(stderr, "chunks do not sum to prompt length\n"); return 1; }
        std::vector<llama_token> tokens(ids.begin(), ids.end());

        auto whole   = run(ctx, n_vocab, tokens, {(int) tokens.size()});
        auto chunked = run(ctx, n_vocab, tokens, chunks);
        auto tbt     = run(ctx, n_vocab, tokens, std::vector<int>(tokens.size(), 1));

        const double d_wc = max_abs_diff(whole, chunked);
        const double d_wt = max_abs_diff(whole, tbt);
        const double d_ct = max_abs_diff(chunked, tbt);
        fprintf(stderr, "prompt %d (%zu tokens): max|whole-chunked| = %.3g, max|whole-tbt| = %.3g, max|chunked-tbt| = %.3g\n",
                p - 5, tokens.size(), d_wc, d_wt, d_ct);

        fprintf(f, "    {\n      \"prompt\": [");
        for (size_t i = 0; i < ids.size(); ++i) fprintf(f, "%s%d", i ? "," : "", ids[i]);
        fprintf(f, "],\n      \"chunks\": [");
        for (size_t i = 0; i < chunks.size(); ++i) fprintf(f, "%s%d", i ? "," : "", chunks[i]);
        fprintf(f, "],\n      \"max_abs_diff\": {\"whole_vs_chunked\": %.9g, \"whole_vs_token_by_token\": %.9g, \"chunked_vs_token_by_token\": %.9g},\n",
                d_wc, d_wt, d_ct);
        fprintf(f, "      \"whole\": ");          write_matrix(f, whole);   fprintf(f, ",\n");
        fprintf(f, "      \"chunked\": ");        write_matrix(f, chunked); fprintf(f, ",\n");
        fprintf(f, "      \"token_by_token\": "); write_matrix(f, tbt);     fprintf(f, "\n");
        fprintf(f, "    }%s\n", p + 1 < argc ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    fclose(f);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
