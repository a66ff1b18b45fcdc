#include "server/metrics.h"

#include <cstdio>

namespace nb {

namespace {

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

class Writer {
 public:
  explicit Writer(const std::string& model) : labels_("model_name=\"" + model + "\",engine=\"0\"") {}
  void header(const std::string& name, const char* type, const char* help) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void gauge(const std::string& name, const char* help, double v) {
    header(name, "gauge", help);
    out += name + "{" + labels_ + "} " + num(v) + "\n";
  }
  void counter(const std::string& name, const char* help, double v) {
    header(name, "counter", help);
    out += name + "_total{" + labels_ + "} " + num(v) + "\n";
  }
  void histogram(const std::string& name, const char* help, const Histogram& h) {
    header(name, "histogram", help);
    uint64_t cum = 0;
    for (size_t i = 0; i <= h.bounds.size(); ++i) {
      cum += h.counts[i];
      const std::string le = i < h.bounds.size() ? num(h.bounds[i]) : "+Inf";
      out += name + "_bucket{" + labels_ + ",le=\"" + le + "\"} " + std::to_string(cum) + "\n";
    }
    out += name + "_sum{" + labels_ + "} " + num(h.sum) + "\n";
    out += name + "_count{" + labels_ + "} " + std::to_string(h.count) + "\n";
  }
  const std::string& labels() const { return labels_; }
  std::string out;

 private:
  std::string labels_;
};

}  // namespace

std::string render_metrics(const EngineStats& s, const std::string& model_name) {
  Writer w(model_name);
  w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.n_running);
  w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.n_waiting);
  w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
          s.n_blocks > 0 ? static_cast<double>(s.n_blocks_used) / s.n_blocks : 0.0);
  w.gauge("nibble:kv_cache_blocks_used", "KV-cache blocks referenced by sequences.", s.n_blocks_used);
  w.gauge("nibble:kv_cache_blocks_total", "KV-cache blocks in the pool.", s.n_blocks);
  w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
            static_cast<double>(s.prompt_tokens));
  w.counter("vllm:generation_tokens", "Number of generation tokens processed.",
            static_cast<double>(s.generation_tokens));
  w.counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
            static_cast<double>(s.preemptions));
  w.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            static_cast<double>(s.prefix_queries));
  w.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            static_cast<double>(s.prefix_hits));
  w.counter("nibble:requests_rejected_queue_full", "Requests refused with 429 because the queue was full.",
            static_cast<double>(s.rejected_queue_full));
  w.header("vllm:request_success_total", "counter", "Count of finished requests, by finish reason.");
  for (const char* reason : {"stop", "length", "abort", "error"}) {
    auto it = s.finished.find(reason);
    w.out += std::string("vllm:request_success_total{") + w.labels() + ",finished_reason=\"" + reason +
             "\"} " + std::to_string(it == s.finished.end() ? 0 : it->second) + "\n";
  }
  w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", s.ttft);
  w.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", s.itl);
  w.histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
              s.e2e);
  w.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
              s.queue_time);
  return w.out;
}

}  // namespace nb
