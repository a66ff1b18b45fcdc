// nibble command line. Every flag is declared once here (CLI11): the same table drives parsing,
// --help, validation and the resolved-configuration log line. Each command lives in its own file.
// Errors: one line on stderr naming what is wrong, exit code 2 for usage and 1 for failures.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "app/bench_args.h"
#include "app/commands.h"
#include "app/model_commands.h"
#include "app/serve_args.h"
#include "base/log.h"

namespace {

const char* kVersion = "0.1.0";

void add_device(CLI::App* cmd, std::string* device, int* threads) {
  cmd->add_option("--device", *device, "Backend: auto (CUDA if available), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--threads", *threads, "CPU backend threads (0: all cores)")->check(CLI::NonNegativeNumber);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"nibble: an inference engine for FP4 (MXFP4, NVFP4) LLM checkpoints", "nibble"};
  app.set_version_flag("--version", kVersion);
  app.require_subcommand(1);
  app.fallthrough();  // -v works after the subcommand too
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Log what is happening (stderr)");

  nb::RunArgs run;
  CLI::App* run_cmd = app.add_subcommand("run", "Generate a continuation of a prompt");
  run_cmd->add_option("-m,--model", run.model, "Model directory")->required();
  auto* p = run_cmd->add_option("-p,--prompt", run.prompt, "Prompt text (raw completion)");
  auto* c = run_cmd->add_option("--chat", run.chat, "A user message, formatted with the model's chat template");
  auto* t = run_cmd->add_option("--prompt-tokens", run.prompt_tokens, "Prompt token ids, separated by spaces");
  p->excludes(c)->excludes(t);
  c->excludes(t);
  run_cmd->add_option("-n,--n-predict", run.n_predict, "Tokens to generate")->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  run_cmd->add_option("--temperature", run.sampling.temperature, "Sampling temperature (0: greedy)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  run_cmd->add_option("--top-p", run.sampling.top_p, "Nucleus sampling mass, (0, 1]")->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  run_cmd->add_option("--top-k", run.sampling.top_k, "Keep the k most likely tokens (0: all)")
      ->check(CLI::Range(-1, 1 << 30))->capture_default_str();
  run_cmd->add_option("--min-p", run.sampling.min_p, "Drop tokens below min-p times the top probability")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  auto* seed = run_cmd->add_option("--seed", run.sampling.seed, "Random seed");
  run_cmd->add_flag("--print-tokens", run.print_tokens, "Print generated token ids instead of text");
  run_cmd->add_flag("--ignore-eos", run.ignore_eos, "Do not stop at end-of-sequence tokens");
  run_cmd->add_option("--max-num-batched-tokens", run.max_num_batched_tokens,
                      "Prefill the prompt in chunks of at most this many tokens (0: one step)")
      ->check(CLI::NonNegativeNumber);
  run_cmd->add_option("--reasoning-effort", run.reasoning_effort, "gpt-oss chats: low, medium or high")
      ->check(CLI::IsMember({"low", "medium", "high"}))->capture_default_str();
  run_cmd->add_flag("--dummy-weights", run.dummy_weights,
                   "Random weights generated from config.json alone (benchmarking shapes; no safetensors read)");
  run_cmd->add_option("--dense-format", run.dense_format,
                      "Re-quantize the BF16 attention projections and lm_head at load (CUDA)")
      ->check(CLI::IsMember({"keep", "fp8", "mxfp4", "nvfp4"}))->capture_default_str();
  run_cmd->add_option("--kv-cache-dtype", run.kv_cache_dtype, "KV cache dtype (CUDA; the CPU backend keeps fp32)")
      ->check(CLI::IsMember({"auto", "bf16", "fp8", "fp8_e4m3"}))->capture_default_str();
  add_device(run_cmd, &run.device, &run.threads);

  nb::EvalArgs eval;
  CLI::App* eval_cmd = app.add_subcommand("eval", "Teacher-forced next-token NLL and perplexity");
  eval_cmd->add_option("-m,--model", eval.model, "Model directory")->required();
  auto* tf = eval_cmd->add_option("--tokens-file", eval.tokens_file, "File of token ids separated by whitespace");
  auto* xf = eval_cmd->add_option("--text-file", eval.text_file, "Text file, tokenized with the model's tokenizer");
  tf->excludes(xf);
  eval_cmd->add_option("--ref-model", eval.ref_model,
                       "Reference model directory (same vocabulary): adds KL(ref || model) and top-1 agreement");
  eval_cmd->add_flag("--json", eval.json,
                     "Print one JSON object {n_tokens, nll, mean_nll, ppl[, kl_mean, kl_p99, top1_agree]}");
  eval_cmd->add_option("--chunk", eval.chunk, "Tokens per forward pass")->check(CLI::PositiveNumber)
      ->capture_default_str();
  eval_cmd->add_option("--seq-len", eval.seq_len, "Split the tokens into independent sequences of N (0: one)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  eval_cmd->add_option("--dense-format", eval.dense_format,
                      "Re-quantize the BF16 attention projections and lm_head at load (CUDA)")
      ->check(CLI::IsMember({"keep", "fp8", "mxfp4", "nvfp4"}))->capture_default_str();
  eval_cmd->add_option("--kv-cache-dtype", eval.kv_cache_dtype, "KV cache dtype (CUDA; the CPU backend keeps fp32)")
      ->check(CLI::IsMember({"auto", "bf16", "fp8", "fp8_e4m3"}))->capture_default_str();
  eval_cmd->add_flag("--dummy-weights", eval.dummy_weights,
                   "Random weights generated from config.json alone (benchmarking shapes; no safetensors read)");
  add_device(eval_cmd, &eval.device, &eval.threads);

  nb::QuantizeArgs quant;
  CLI::App* quant_cmd = app.add_subcommand("quantize", "Write a BF16 checkpoint as MXFP4, NVFP4 or FP8");
  quant_cmd->add_option("-m,--model", quant.model, "BF16 model directory")->required();
  quant_cmd->add_option("-o,--output", quant.output, "Output directory")->required();
  quant_cmd->add_option("--format", quant.format,
                        "mxfp4 (gpt-oss experts), nvfp4 (ModelOpt) or fp8 (compressed-tensors, per channel)")
      ->required()->check(CLI::IsMember({"mxfp4", "nvfp4", "fp8"}));
  quant_cmd->add_option("--layers", quant.layers,
                        "Layer classes, comma-separated: experts, attn, mlp, lm_head, embed (default: gpt-oss "
                        "experts; others attn,mlp,experts)");


  nb::TokenizeArgs tok;
  CLI::App* tok_cmd = app.add_subcommand("tokenize", "Text on stdin to token ids (or back with --decode)");
  tok_cmd->add_option("-m,--model", tok.model, "Model directory, tokenizer.json or .tiktoken file")->required();
  tok_cmd->add_flag("--special", tok.special, "Let special-token text become special ids");
  tok_cmd->add_flag("--decode", tok.decode, "Ids on stdin to text");
  tok_cmd->add_flag("--jsonl", tok.jsonl, "One JSON string (or JSON id array with --decode) per line");

  nb::InspectArgs inspect;
  CLI::App* inspect_cmd = app.add_subcommand("inspect", "Architecture, shapes and formats of a checkpoint");
  inspect_cmd->add_option("-m,--model", inspect.model, "Model directory")->required();

  nb::ServeArgs serve;
  CLI::App* serve_cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (flags named as in vLLM)");
  serve_cmd->add_option("-m,--model", serve.model, "Model directory")->required();
  serve_cmd->add_option("--host", serve.host, "Address to bind")->capture_default_str();
  serve_cmd->add_option("--port", serve.port, "Port (0: any free port)")->check(CLI::Range(0, 65535))
      ->capture_default_str();
  add_device(serve_cmd, &serve.device, &serve.threads);
  serve_cmd->add_flag("--dummy-weights", serve.dummy_weights,
                   "Random weights generated from config.json alone (benchmarking shapes; no safetensors read)");
  serve_cmd->add_option("--served-model-name", serve.served_model_name, "Model name in the API (default: -m)");
  serve_cmd->add_option("--max-model-len", serve.max_model_len, "Context length (default: the model's)")
      ->check(CLI::NonNegativeNumber);
  serve_cmd->add_option("--max-num-seqs", serve.max_num_seqs, "Sequences per batch")->check(CLI::PositiveNumber)
      ->capture_default_str();
  serve_cmd->add_option("--max-num-batched-tokens", serve.max_num_batched_tokens,
                        "Tokens per engine step (0: max(2048, --max-num-seqs))")->check(CLI::NonNegativeNumber);
  serve_cmd->add_option("--max-queue", serve.max_queue, "Waiting requests before 429")->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  serve_cmd->add_option("--num-gpu-blocks-override", serve.num_gpu_blocks_override,
                        "KV cache blocks of 16 tokens (0: from --kv-cache-memory-bytes)")->check(CLI::NonNegativeNumber);
  serve_cmd->add_option("--kv-cache-memory-bytes", serve.kv_cache_memory_bytes, "KV cache memory budget")
      ->check(CLI::PositiveNumber)->capture_default_str();
  serve_cmd->add_option("--api-key", serve.api_key, "Require 'Authorization: Bearer KEY' on /v1");
  serve_cmd->add_option("--allowed-origins", serve.allowed_origins, "CORS origins ('*': any; default: CORS off)");
  serve_cmd->add_option("--kv-cache-dtype", serve.kv_cache_dtype, "KV cache dtype (CUDA; the CPU backend keeps fp32)")
      ->check(CLI::IsMember({"auto", "bf16", "fp8", "fp8_e4m3"}))->capture_default_str();
  serve_cmd->add_option("--dense-format", serve.dense_format,
                      "Re-quantize the BF16 attention projections and lm_head at load (CUDA)")
      ->check(CLI::IsMember({"keep", "fp8", "mxfp4", "nvfp4"}))->capture_default_str();
  serve_cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", serve.enable_prefix_caching,
                      "Reuse KV blocks of shared prompt prefixes")->capture_default_str();
  serve_cmd->add_flag("--async-scheduling,!--no-async-scheduling", serve.async_scheduling,
                      "Queue each decode step before reading the previous step's sampled ids")->capture_default_str();
  serve_cmd->add_option("--max-request-bytes", serve.max_request_bytes, "Larger request bodies get 413")
      ->check(CLI::PositiveNumber)->capture_default_str();
  serve_cmd->add_option("--shutdown-timeout", serve.shutdown_timeout, "Seconds to drain after SIGTERM")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  serve_cmd->add_option("--chat-format", serve.chat_format, "Override the chat format: harmony, chatml, llama3");
  serve_cmd->add_flag("--test-forced-output", serve.test_forced_output,
                      "Tests only: honour the request field nibble_forced_output")->group("");

  nb::BenchArgs bench;
  CLI::App* bench_cmd = app.add_subcommand("bench", "Benchmark an OpenAI-compatible server (llama-benchy 0.2.1 metrics)");
  bench_cmd->add_option("--base-url", bench.base_url, "Server URL including /v1, e.g. http://127.0.0.1:8000/v1")
      ->required();
  bench_cmd->add_option("--api-key", bench.api_key, "Bearer token")->capture_default_str();
  bench_cmd->add_option("--model", bench.model, "Model name: the row label, and the default for the two below")
      ->required();
  bench_cmd->add_option("--served-model-name", bench.served_model_name, "Model name sent in requests");
  bench_cmd->add_option("--tokenizer", bench.tokenizer, "tokenizer.json or model directory (local only)");
  bench_cmd->add_option("--pp", bench.pp, "Prompt token counts")->check(CLI::PositiveNumber)->capture_default_str();
  bench_cmd->add_option("--tg", bench.tg, "Generated token counts")->check(CLI::PositiveNumber)->capture_default_str();
  bench_cmd->add_option("--depth", bench.depth, "Context depths (system-message tokens)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  bench_cmd->add_option("--runs", bench.runs, "Runs per test")->check(CLI::PositiveNumber)->capture_default_str();
  bench_cmd->add_option("--concurrency", bench.concurrency, "Concurrency levels (parallel requests per run)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  bench_cmd->add_option("--latency-mode", bench.latency_mode, "Latency subtracted from ttfr for est_ppt")
      ->check(CLI::IsMember({"api", "generation", "none"}))->capture_default_str();
  bench_cmd->add_flag("--enable-prefix-caching", bench.enable_prefix_caching,
                      "With depth > 0: load the context first (ctx_pp/ctx_tg rows), then time the prompt alone");
  bench_cmd->add_flag("--no-cache", bench.no_cache, "Unique prompts and cache_prompt=false");
  bench_cmd->add_flag("--no-warmup", bench.no_warmup, "Skip the warm-up (still done when adapting the prompt)");
  bench_cmd->add_flag("!--no-adapt-prompt", bench.adapt_prompt, "Do not subtract the chat template's tokens");
  bench_cmd->add_option("--text-file", bench.text_file,
                        "Prompt corpus (default: the bundled data/tinyshakespeare.txt; llama-benchy's default, "
                        "Gutenberg #1661, is not downloaded)");
  bench_cmd->add_option("--format", bench.format, "Result format")->check(CLI::IsMember({"md", "json", "csv"}))
      ->capture_default_str();
  bench_cmd->add_option("--save-result", bench.save_result, "Write the results to this file instead of stdout");
  bench_cmd->add_option("--plot", bench.plot, "SVG of throughput and latency against concurrency");
  bench_cmd->add_option("--save-requests", bench.save_requests, "JSONL of every request's raw timings");
  bench_cmd->add_option("--timeout", bench.timeout, "Seconds per request before it counts as failed")
      ->check(CLI::PositiveNumber)->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "nibble: error: %s (see nibble --help)\n", e.what());
    return 2;
  }
  nb::set_log_level(verbose ? nb::LogLevel::kInfo : nb::LogLevel::kWarn);
  run.sampling.has_seed = seed->count() > 0;

  if (app.got_subcommand(run_cmd)) {
    if (run.prompt.empty() && run.chat.empty() && run.prompt_tokens.empty()) {
      std::fprintf(stderr, "nibble: error: run needs a prompt: -p TEXT, --chat TEXT or --prompt-tokens IDS\n");
      return 2;
    }
    return nb::cmd_run(run);
  }
  if (app.got_subcommand(eval_cmd)) {
    if (eval.tokens_file.empty() && eval.text_file.empty()) {
      std::fprintf(stderr, "nibble: error: eval needs --tokens-file F or --text-file F\n");
      return 2;
    }
    return nb::cmd_eval(eval);
  }
  if (app.got_subcommand(quant_cmd)) return nb::cmd_quantize(quant);
  if (app.got_subcommand(tok_cmd)) return nb::cmd_tokenize(tok);
  if (app.got_subcommand(inspect_cmd)) return nb::cmd_inspect(inspect);
  if (app.got_subcommand(serve_cmd)) return nb::cmd_serve(serve);
  if (app.got_subcommand(bench_cmd)) return nb::cmd_bench(bench);
  return 2;
}
