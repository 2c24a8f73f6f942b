// tokenize_llama: tokenize strings with a GGUF's vocab through llama.cpp (vocab only).
//
// stdin: one string per line, hex-encoded UTF-8 (empty line = empty string).
// stdout: JSON list, one object per input line:
//   {"hex": ..., "ids": [...parse_special=true...], "ids_ordinary": [...parse_special=false...]}
// add_special is false in both (no BOS is added).
//
// Build: g++ -O2 -std=c++17 tokenize_llama.cpp -I$LLAMA/include -I$LLAMA/ggml/include \
//            -L$BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,$BUILD/bin -o tokenize_llama

#include "llama.h"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

static std::string unhex(const std::string & h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back((char) std::stoi(h.substr(i, 2), nullptr, 16));
    return out;
}

static std::vector<llama_token> tok(const llama_vocab * vocab, const std::string & s, bool parse_special) {
    std::vector<llama_token> ids(s.size() + 8);
    int n = llama_tokenize(vocab, s.data(), (int) s.size(), ids.data(), (int) ids.size(), false, parse_special);
    if (n < 0) { ids.resize(-n); n = llama_tokenize(vocab, s.data(), (int) s.size(), ids.data(), (int) ids.size(), false, parse_special); }
    ids.resize(n);
    return ids;
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s MODEL.gguf < hex-lines\n", argv[0]); return 2; }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    std::string line;
    bool first = true;
    printf("[\n");
    while (std::getline(std::cin, line)) {
        const std::string s = unhex(line);
        printf("%s  {\"hex\": \"%s\", \"ids\": [", first ? "" : ",\n", line.c_str());
        first = false;
        auto a = tok(vocab, s, true);
        for (size_t i = 0; i < a.size(); ++i) printf("%s%d", i ? "," : "", a[i]);
        printf("], \"ids_ordinary\": [");
        auto b = tok(vocab, s, false);
        for (size_t i = 0; i < b.size(); ++i) printf("%s%d", i ? "," : "", b[i]);
        printf("]}");
    }
    printf("\n]\n");
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
