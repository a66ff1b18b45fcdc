#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace nb {

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    return error("temperature must be a finite number >= 0, got " + std::to_string(temperature));
  if (!(top_p > 0.0f && top_p <= 1.0f)) return error("top_p must be in (0, 1], got " + std::to_string(top_p));
  if (top_k < -1) return error("top_k must be -1, 0 (all) or positive, got " + std::to_string(top_k));
  if (!(min_p >= 0.0f && min_p <= 1.0f))
    return error("min_p must be in [0, 1], got " + std::to_string(min_p));
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    return error("presence_penalty must be in [-2, 2], got " + std::to_string(presence_penalty));
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    return error("frequency_penalty must be in [-2, 2], got " + std::to_string(frequency_penalty));
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    return error("repetition_penalty must be a finite number > 0, got " + std::to_string(repetition_penalty));
  return Status();
}

bool has_penalties(const SamplingParams& p) {
  return p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f || p.repetition_penalty != 1.0f;
}

void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt,
                     std::span<const int32_t> output) {
  const auto vocab = static_cast<int32_t>(logits.size());
  auto valid = [&](int32_t id) { return id >= 0 && id < vocab; };
  if (p.repetition_penalty != 1.0f) {
    std::unordered_set<int32_t> seen;
    for (auto ids : {prompt, output})
      for (int32_t id : ids)
        if (valid(id) && seen.insert(id).second) {
          float& l = logits[id];
          l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
        }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t id : output)
      if (valid(id)) ++counts[id];
    for (auto [id, n] : counts) logits[id] -= p.frequency_penalty * n + p.presence_penalty;
  }
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t id, int top_n) {
  NB_CHECK(!logits.empty() && id >= 0 && static_cast<size_t>(id) < logits.size());
  double max_logit = logits[0];
  for (float l : logits) max_logit = std::max<double>(max_logit, l);
  double sum = 0;
  for (float l : logits) sum += std::exp(l - max_logit);
  const double log_z = max_logit + std::log(sum);
  TokenLogprobs out;
  out.logprob = static_cast<float>(logits[id] - log_z);
  const int n = std::min<int>(std::max(top_n, 0), static_cast<int>(logits.size()));
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int i = 0; i < n; ++i) out.top.emplace_back(ids[i], static_cast<float>(logits[ids[i]] - log_z));
  return out;
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params), rng_(params.has_seed ? params.seed : std::random_device{}()) {}

int32_t argmax(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  return best;
}

SampleSpec Sampler::next() {
  SampleSpec s{params_.temperature, params_.top_p, params_.top_k, params_.min_p, 0.0};
  if (!params_.greedy()) s.u = std::generate_canonical<double, std::numeric_limits<double>::digits>(rng_);
  return s;
}

int32_t Sampler::sample(std::span<const float> logits) { return sample_row(logits, next()); }

int32_t sample_row(std::span<const float> logits, const SampleSpec& spec) {
  NB_CHECK(!logits.empty());
  if (spec.temperature <= 0.0f) return argmax(logits);
  const int vocab = static_cast<int>(logits.size());

  // Candidates sorted by logit, descending (ties: lower id first), cut to top-k.
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  const int k = (spec.top_k > 0 && spec.top_k < vocab) ? spec.top_k : vocab;
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  ids.resize(k);

  // Softmax at temperature, in double for a stable cumulative sum.
  std::vector<double> p(k);
  const double max_logit = logits[ids[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) sum += p[i] = std::exp((logits[ids[i]] - max_logit) / spec.temperature);
  for (double& v : p) v /= sum;

  // Top-p: the smallest prefix whose mass reaches top_p (at least one token).
  int n = k;
  if (spec.top_p < 1.0f) {
    double cum = 0;
    for (int i = 0; i < k; ++i) {
      cum += p[i];
      if (cum >= spec.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  // Min-p: drop tokens whose probability is below min_p times the top one.
  if (spec.min_p > 0.0f) {
    const double floor_p = spec.min_p * p[0];
    while (n > 1 && p[n - 1] < floor_p) --n;
  }
  double mass = 0;
  for (int i = 0; i < n; ++i) mass += p[i];
  // u * mass is what std::uniform_real_distribution(0, mass) draws from the same canonical u.
  const double u = spec.u * mass;
  double cum = 0;
  for (int i = 0; i < n; ++i) {
    cum += p[i];
    if (u < cum) return ids[i];
  }
  return ids[n - 1];
}

}  // namespace nb
