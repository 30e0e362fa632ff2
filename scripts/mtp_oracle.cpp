// Upstream's own MTP draft driver (common/speculative.cpp, common_speculative_impl_draft_mtp) on a GGUF
// whose MTP heads libllama loads, driven the way llama-server drives it: every target batch is handed to
// common_speculative_process, a draft is followed by removing the draft context's positions past the
// target's, and after a verify common_speculative_accept is told how many drafts passed and both memories
// drop the rejected positions. It prints what it drafted per cycle, so tests/test_mtp.py can hold
// dflash_gguf.mtp.MTPSource to exactly the same tokens.
//
//   mtp_oracle MODEL PROMPT CYCLES [THREADS [HEADS]]
//     HEADS: the MTP heads as a model of their own (gemma4's assistant, whose KV is the target's), drafted
//            from as llama-server drafts from a --model-draft of type draft-mtp
//     PROMPT: comma-separated token ids (decoded as one batch; the first token after it is the argmax)
//     CYCLES: comma-separated N:K, one per cycle: draft N tokens (0: a plain cycle), verify [last, drafts],
//             commit the first K drafts (K = g: as many as the target's argmax agrees with), then the
//             target's argmax after them
//   prints one line per cycle: "draft t1 t2 ...", then "commit t0 t1 ..." (the tokens the cycle committed)

#include "common.h"
#include "llama.h"
#include "speculative.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

static std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) {
            out.push_back(item);
        }
    }
    return out;
}

static llama_token argmax(llama_context * ctx, int32_t i, int32_t n_vocab) {
    const float * logits = llama_get_logits_ith(ctx, i);
    return (llama_token) (std::max_element(logits, logits + n_vocab) - logits);
}

static void print_tokens(const char * label, const llama_tokens & tokens) {
    printf("%s", label);
    for (const llama_token t : tokens) {
        printf(" %d", t);
    }
    printf("\n");
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL PROMPT CYCLES [THREADS]\n", argv[0]);
        return 2;
    }
    const int n_threads = argc > 4 ? atoi(argv[4]) : 1;
    const char * heads_path = argc > 5 ? argv[5] : nullptr;
    const int32_t n_ctx = 512, n_batch = 64, n_draft_max = 16;

    llama_tokens prompt;
    for (const auto & t : split(argv[2], ',')) {
        prompt.push_back(atoi(t.c_str()));
    }
    std::vector<std::pair<int, int>> cycles;  // (n_draft, n_commit; -1 = greedy)
    for (const auto & c : split(argv[3], ',')) {
        const auto parts = split(c, ':');
        if (parts.size() != 2) {
            fprintf(stderr, "bad cycle '%s' (want N:K)\n", c.c_str());
            return 2;
        }
        cycles.emplace_back(atoi(parts[0].c_str()), parts[1] == "g" ? -1 : atoi(parts[1].c_str()));
    }
    if (prompt.empty() || (int32_t) prompt.size() > n_batch) {
        fprintf(stderr, "the prompt must hold 1..%d tokens\n", n_batch);
        return 2;
    }

    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.load_mtp = true;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_model * heads = model;
    if (heads_path) {
        heads = llama_model_load_from_file(heads_path, mparams);
        if (!heads) {
            fprintf(stderr, "cannot load %s\n", heads_path);
            return 1;
        }
    }

    // the target context as dflash_gguf's Target makes it (flash attention on, one graph per batch), with
    // recurrent-state snapshots for the rollback a hybrid target needs; the MTP context as upstream makes it
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n_ctx;
    cparams.n_batch = n_batch;
    cparams.n_ubatch = n_batch;
    cparams.n_seq_max = 1;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cparams.n_rs_seq = n_draft_max;
    llama_context * ctx_tgt = llama_init_from_model(model, cparams);

    llama_context_params dparams_ctx = cparams;
    dparams_ctx.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    dparams_ctx.n_rs_seq = 0;
    dparams_ctx.ctx_other = ctx_tgt;
    llama_context * ctx_dft = ctx_tgt ? llama_init_from_model(heads, dparams_ctx) : nullptr;
    if (!ctx_tgt || !ctx_dft) {
        fprintf(stderr, "cannot create the target or the MTP context\n");
        return 1;
    }

    common_params_speculative sparams;
    sparams.types = { COMMON_SPECULATIVE_TYPE_DRAFT_MTP };
    sparams.draft.n_max = n_draft_max;
    sparams.draft.n_min = 0;
    sparams.draft.p_min = 0.0f;
    sparams.draft.ctx_tgt = ctx_tgt;
    sparams.draft.ctx_dft = ctx_dft;
    common_speculative * spec = common_speculative_init(sparams, 1);
    if (!spec) {
        fprintf(stderr, "common_speculative_init made no MTP driver\n");
        return 1;
    }

    common_batch batch(ctx_tgt);
    for (size_t i = 0; i < prompt.size(); ++i) {
        batch.add(prompt[i], (llama_pos) i, 0, i + 1 == prompt.size());
    }
    if (llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch.get()) != 0 || !common_speculative_process(spec, batch)) {
        fprintf(stderr, "prefill failed\n");
        return 1;
    }
    llama_tokens committed = prompt;
    llama_token last = argmax(ctx_tgt, (int32_t) prompt.size() - 1, n_vocab);
    common_speculative_begin(spec, 0, committed);

    auto * mem_tgt = llama_get_memory(ctx_tgt);
    auto * mem_dft = llama_get_memory(ctx_dft);
    for (const auto & [n_draft, n_commit] : cycles) {
        const llama_pos n_past = (llama_pos) committed.size();  // the position of `last`
        llama_tokens draft;
        if (n_draft > 0) {
            auto & dp = common_speculative_get_draft_params(spec, 0);
            dp = { /* .drafting = */ true, /* .n_max = */ n_draft, /* .pos0 = */ n_past, /* .id_last = */ last,
                   /* .prompt = */ &committed, /* .result = */ &draft };
            common_speculative_draft(spec);
            llama_memory_seq_rm(mem_dft, 0, n_past, -1);  // the server's seq_rm(ckpt.pos_max + 1) after a draft
        }
        print_tokens("draft", draft);

        batch.clear();
        batch.add(last, n_past, 0, true);
        for (size_t i = 0; i < draft.size(); ++i) {
            batch.add(draft[i], n_past + 1 + (llama_pos) i, 0, true);
        }
        if (llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch.get()) != 0 || !common_speculative_process(spec, batch)) {
            fprintf(stderr, "verify failed\n");
            return 1;
        }
        int k = 0;
        if (n_commit < 0) {
            while (k < (int) draft.size() && argmax(ctx_tgt, k, n_vocab) == draft[k]) {
                ++k;
            }
        } else {
            k = std::min(n_commit, (int) draft.size());
        }
        const llama_token bonus = argmax(ctx_tgt, k, n_vocab);
        if (!draft.empty()) {
            common_speculative_accept(spec, 0, (uint16_t) k);
        }
        llama_tokens done = { last };
        done.insert(done.end(), draft.begin(), draft.begin() + k);
        committed.insert(committed.end(), done.begin(), done.end());
        llama_memory_seq_rm(mem_tgt, 0, (llama_pos) committed.size(), -1);
        llama_memory_seq_rm(mem_dft, 0, (llama_pos) committed.size(), -1);
        print_tokens("commit", done);
        last = bonus;
    }

    common_speculative_free(spec);
    llama_free(ctx_dft);
    llama_free(ctx_tgt);
    if (heads != model) {
        llama_model_free(heads);
    }
    llama_model_free(model);
    return 0;
}
