// /metrics: the engine's statistics in Prometheus text format under vLLM's metric names, so vLLM
// dashboards and autoscalers (num_requests_waiting, kv_cache_usage_perc, TTFT, ITL) work unchanged.
#pragma once

#include <string>

#include "runtime/engine_stats.h"

namespace nb {

std::string render_metrics(const EngineStats& stats, const std::string& model_name);

}  // namespace nb
