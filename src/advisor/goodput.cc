// The goodput model, analytic and Monte-Carlo, and the strategies it compares (goodput.h).
#include "advisor/goodput.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <random>

namespace safepoint::advisor {
namespace {

double TotalRate(const StrategyAtInterval& s) {
  double rate = 0;
  for (const auto& m : s.modes) rate += m.rate_per_second;
  return rate;
}

// An exponential variate from the generator's bits (the same on every standard library).
double Exponential(std::mt19937_64& gen, double rate) {
  const double u = static_cast<double>(gen() >> 11) * 0x1.0p-53;  // [0, 1)
  return -std::log1p(-u) / rate;
}

size_t PickMode(std::mt19937_64& gen, const StrategyAtInterval& s, double rate) {
  double u = static_cast<double>(gen() >> 11) * 0x1.0p-53 * rate;
  for (size_t i = 0; i < s.modes.size(); ++i) {
    if (u < s.modes[i].rate_per_second) return i;
    u -= s.modes[i].rate_per_second;
  }
  return s.modes.size() - 1;
}

}  // namespace

double AnalyticGoodput(const StrategyAtInterval& s) {
  const double p = s.period_seconds;
  const double c = s.blocking_seconds;
  if (!(p > c) || !(c >= 0)) return 0;
  const double rate = TotalRate(s);
  if (rate <= 0) return (p - c) / p;
  double a = 0;
  double b = 0;
  for (const auto& m : s.modes) {
    const double share = m.rate_per_second / rate;
    const double fail = -std::expm1(-rate * m.recovery_seconds);  // 1 - e^{-lambda D}
    a += share * fail / rate;
    b += share * fail;
  }
  if (b >= 1) return 0;
  const double v = a / (1 - b);
  const double expected = std::expm1(rate * p) * (1 / rate + v);
  if (!std::isfinite(expected) || expected <= 0) return 0;
  return (p - c) / expected;
}

MonteCarloResult MonteCarloGoodput(const StrategyAtInterval& s, double horizon_seconds,
                                   uint64_t seed) {
  MonteCarloResult r;
  const double p = s.period_seconds;
  const double c = s.blocking_seconds;
  if (!(p > c) || !(horizon_seconds > 0)) return r;
  const double rate = TotalRate(s);
  std::mt19937_64 gen(seed);
  constexpr int kBatches = 32;
  const double batch_horizon = horizon_seconds / kBatches;
  double useful_total = 0;
  double wall_total = 0;
  double sum = 0;
  double sum_sq = 0;
  for (int batch = 0; batch < kBatches; ++batch) {
    double t = 0;
    double useful = 0;
    while (t < batch_horizon) {
      const double d = rate > 0 ? Exponential(gen, rate) : INFINITY;
      if (d >= p) {
        t += p;
        useful += p - c;
        continue;
      }
      t += d;  // the period is lost; recover
      ++r.failures;
      size_t mode = PickMode(gen, s, rate);
      for (;;) {
        const double need = s.modes[mode].recovery_seconds;
        const double next = Exponential(gen, rate);
        if (next >= need) {
          t += need;
          break;
        }
        t += next;
        ++r.failures;
        mode = PickMode(gen, s, rate);
      }
    }
    const double g = useful / t;
    sum += g;
    sum_sq += g * g;
    useful_total += useful;
    wall_total += t;
  }
  r.goodput = useful_total / wall_total;
  r.wall_seconds = wall_total;
  const double mean = sum / kBatches;
  const double var = std::max(0.0, (sum_sq - kBatches * mean * mean) / (kBatches - 1));
  r.standard_error = std::sqrt(var / kBatches);
  return r;
}

void DeriveCosts(const ClusterSpeeds& sp, SimulationInputs* in) {
  const double state = sp.state_bytes_per_gpu;
  if (state <= 0) return;
  const double gpus = in->gpus;
  if (sp.memory_bytes_per_second > 0) {
    in->snapshot_seconds = state / sp.memory_bytes_per_second;
    in->restore_memory_seconds = in->snapshot_seconds;
  }
  if (sp.storage_write_bytes_per_second > 0) {
    in->persist_seconds = gpus * state / sp.storage_write_bytes_per_second;
    const double read = sp.storage_read_bytes_per_second > 0 ? sp.storage_read_bytes_per_second
                                                             : sp.storage_write_bytes_per_second;
    in->restore_storage_seconds = gpus * state / read;
  }
  if (sp.network_bytes_per_second > 0) {
    in->restore_peer_seconds = in->gpus_per_node * state / sp.network_bytes_per_second;
  }
}

Result<double> ParseBytes(const std::string& text) {
  const auto bad = [&] {
    return InvalidArgument("'" + text + "' is not a size (a number with K, M, G, T or Ki, Mi, " +
                           "Gi, Ti, optionally B or B/s)");
  };
  if (text.empty()) return bad();
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !std::isfinite(v) || v < 0) return bad();
  std::string unit(end);
  if (unit.size() >= 2 && unit.compare(unit.size() - 2, 2, "/s") == 0) unit.resize(unit.size() - 2);
  if (!unit.empty() && unit.back() == 'B') unit.pop_back();
  double scale = 1;
  bool binary = false;
  if (!unit.empty() && unit.back() == 'i') {
    binary = true;
    unit.pop_back();
  }
  if (unit.size() > 1) return bad();
  const std::string prefixes = "KMGT";
  if (!unit.empty()) {
    const size_t i = prefixes.find(static_cast<char>(std::toupper(unit[0])));
    if (i == std::string::npos) return bad();
    scale = std::pow(binary ? 1024.0 : 1000.0, static_cast<double>(i + 1));
  } else if (binary) {
    return bad();
  }
  return v * scale;
}

Result<SimulationInputs> CompleteInputs(SimulationInputs in) {
  auto check = [](const char* what, double v) -> Status {
    if (!std::isfinite(v) || v < 0) {
      return InvalidArgument(std::string(what) + " must be a finite number >= 0, got " +
                             std::to_string(v));
    }
    return Status::OK();
  };
  if (!(std::isfinite(in.mtbf_seconds) && in.mtbf_seconds > 0)) {
    return InvalidArgument("the MTBF must be given and positive (--mtbf, or --node-mtbf)");
  }
  if (!(in.node_loss_fraction >= 0 && in.node_loss_fraction <= 1)) {
    return InvalidArgument("the share of node losses must be in [0, 1]");
  }
  if (in.gpus == 0 || in.gpus_per_node == 0) {
    return InvalidArgument("the cluster needs at least one GPU and one GPU per node");
  }
  if (in.peer_copies && Nodes(in) < 2) {
    return InvalidArgument("peer copies need at least two nodes; the job has " +
                           std::to_string(in.gpus) + " GPU" + (in.gpus == 1 ? "" : "s") +
                           " on one node (--gpus, --gpus-per-node)");
  }
  if (!(std::isfinite(in.step_seconds) && in.step_seconds >= 0)) {
    return InvalidArgument("the step time must be a finite number >= 0");
  }
  if (in.sync_save_seconds == 0) in.sync_save_seconds = in.persist_seconds;
  if (in.dcp_blocking_seconds == 0) in.dcp_blocking_seconds = in.snapshot_seconds;
  if (in.restore_memory_seconds == 0) in.restore_memory_seconds = in.snapshot_seconds;
  if (in.restore_storage_seconds == 0) in.restore_storage_seconds = in.persist_seconds;
  if (in.restore_peer_seconds == 0) in.restore_peer_seconds = in.restore_storage_seconds;
  SP_RETURN_IF_ERROR(check("the snapshot time", in.snapshot_seconds));
  SP_RETURN_IF_ERROR(check("the persist time", in.persist_seconds));
  SP_RETURN_IF_ERROR(check("the restart time", in.restart_seconds));
  SP_RETURN_IF_ERROR(check("the restore time from memory", in.restore_memory_seconds));
  SP_RETURN_IF_ERROR(check("the restore time from a peer", in.restore_peer_seconds));
  SP_RETURN_IF_ERROR(check("the restore time from storage", in.restore_storage_seconds));
  SP_RETURN_IF_ERROR(check("the synchronous save time", in.sync_save_seconds));
  SP_RETURN_IF_ERROR(check("the DCP staging time", in.dcp_blocking_seconds));
  return in;
}

uint32_t Nodes(const SimulationInputs& in) {
  if (in.gpus_per_node == 0) return in.gpus;
  return (in.gpus + in.gpus_per_node - 1) / in.gpus_per_node;
}

uint64_t PersistEverySaves(double persist_seconds, double period_seconds) {
  if (!(persist_seconds > 0) || !(period_seconds > 0)) return 1;
  // A hair of tolerance: a persist of exactly two periods takes every second snapshot.
  const double m = std::ceil(persist_seconds / period_seconds * (1 - 1e-12));
  if (!std::isfinite(m) || m >= 1e15) return 1000000000000000ull;
  return std::max<uint64_t>(1, static_cast<uint64_t>(m));
}

std::vector<StrategyAtInterval> Strategies(const SimulationInputs& in, double period) {
  const double rate = 1 / in.mtbf_seconds;
  const double crash_rate = rate * (1 - in.node_loss_fraction);
  const double node_rate = rate * in.node_loss_fraction;
  std::vector<StrategyAtInterval> out;

  StrategyAtInterval sp{"safepoint", period, in.snapshot_seconds, {}};
  sp.modes.push_back({"process crash", crash_rate, in.restart_seconds + in.restore_memory_seconds});
  if (in.peer_copies) {
    sp.modes.push_back({"node loss", node_rate, in.restart_seconds + in.restore_peer_seconds});
  } else {
    const double m = static_cast<double>(PersistEverySaves(in.persist_seconds, period));
    const double lag = (m - 1) * period / 2 + in.persist_seconds;
    sp.modes.push_back(
        {"node loss", node_rate, in.restart_seconds + in.restore_storage_seconds + lag});
  }
  out.push_back(std::move(sp));

  StrategyAtInterval sync{"sync", period, in.sync_save_seconds, {}};
  sync.modes.push_back({"any failure", rate, in.restart_seconds + in.restore_storage_seconds});
  out.push_back(std::move(sync));

  const double wait = std::max(0.0, in.persist_seconds - period);
  StrategyAtInterval dcp{"dcp-async", period, in.dcp_blocking_seconds + wait, {}};
  const double lag = period > dcp.blocking_seconds ? std::min(in.persist_seconds, period) *
                                                         (period - dcp.blocking_seconds) / period
                                                   : 0;
  dcp.modes.push_back({"any failure", rate, in.restart_seconds + in.restore_storage_seconds + lag});
  out.push_back(std::move(dcp));
  return out;
}

double OptimalPeriod(const SimulationInputs& in, size_t index, double lo, double hi) {
  auto g = [&](double log_p) { return AnalyticGoodput(Strategies(in, std::exp(log_p)).at(index)); };
  // A coarse scan first (the goodput is 0 below the blocking time), then golden section.
  double a = std::log(lo);
  double b = std::log(hi);
  constexpr int kScan = 64;
  double best = a;
  double best_g = -1;
  for (int i = 0; i <= kScan; ++i) {
    const double x = a + (b - a) * i / kScan;
    const double v = g(x);
    if (v > best_g) {
      best_g = v;
      best = x;
    }
  }
  const double step = (b - a) / kScan;
  a = std::max(a, best - step);
  b = std::min(b, best + step);
  const double phi = (std::sqrt(5.0) - 1) / 2;
  double x1 = b - phi * (b - a);
  double x2 = a + phi * (b - a);
  double g1 = g(x1);
  double g2 = g(x2);
  for (int i = 0; i < 80; ++i) {
    if (g1 < g2) {
      a = x1;
      x1 = x2;
      g1 = g2;
      x2 = a + phi * (b - a);
      g2 = g(x2);
    } else {
      b = x2;
      x2 = x1;
      g2 = g1;
      x1 = b - phi * (b - a);
      g1 = g(x1);
    }
  }
  return std::exp((a + b) / 2);
}

}  // namespace safepoint::advisor
