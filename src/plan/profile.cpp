#include "plan/profile.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace tessera::plan {

GradientProfile profile_gradients(const runtime::Model& model, const std::vector<CalibrationSample>& samples,
                                  std::vector<int32_t> levels, const ProbeRegions& regions, ThreadPool& pool,
                                  const ProfileProgress& progress, Device device, bool keep_samples) {
  const auto t0 = std::chrono::steady_clock::now();
  check(!samples.empty(), "profile: no calibration samples");
  std::sort(levels.begin(), levels.end());
  levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
  check(!levels.empty(), "profile: no length levels");
  const auto& cfg = model.config();
  GradientProfile p;
  p.num_layers = cfg.num_layers;
  p.num_q_heads = cfg.num_q_heads;
  p.probe.assign(static_cast<size_t>(cfg.num_layers), {});
  for (int32_t len : levels) {
    LengthProfile lp;
    lp.length = len;
    lp.num_blocks = (len + kProfileBlock - 1) / kProfileBlock;
    p.lengths.push_back(std::move(lp));
  }
  GradientOptions opt;
  opt.block = kProfileBlock;
  opt.regions = regions;
  opt.device = device;
  int32_t done = 0;
  for (const CalibrationSample& s : samples) {
    const auto n = static_cast<int32_t>(s.tokens.size());
    auto it = std::find_if(p.lengths.begin(), p.lengths.end(), [&](const LengthProfile& l) { return l.length >= n; });
    check(it != p.lengths.end(), "profile: sample " + s.name + " has " + std::to_string(n) +
                                     " tokens, more than the largest length level " + std::to_string(levels.back()));
    const GradientResult r = attention_gradients(model, s.tokens, s.targets, opt, pool);
    p.loss += r.loss;
    LengthProfile& lp = *it;
    const size_t nb = static_cast<size_t>(lp.num_blocks);
    if (lp.influence.empty())
      lp.influence.assign(static_cast<size_t>(cfg.num_layers) * static_cast<size_t>(cfg.num_q_heads) * nb * nb, 0.0);
    std::vector<double> mine(lp.influence.size(), 0.0);  // this sample's block sums
    for (int32_t l = 0; l < cfg.num_layers; ++l) {
      const LayerGradients& g = r.layers[static_cast<size_t>(l)];
      for (int32_t h = 0; h < cfg.num_q_heads; ++h)
        for (int32_t qb = 0; qb < r.num_blocks; ++qb)
          for (int32_t kb = 0; kb <= qb; ++kb)
            mine[((static_cast<size_t>(l) * static_cast<size_t>(cfg.num_q_heads) + static_cast<size_t>(h)) *
                              nb +
                          static_cast<size_t>(qb)) *
                             nb +
                         static_cast<size_t>(kb)] = r.block_sum(g.influence, h, qb, kb);
      LayerProbe& dst = p.probe[static_cast<size_t>(l)];
      for (auto [d, src] : {std::pair{&dst.streaming, &g.probe.streaming}, std::pair{&dst.middle, &g.probe.middle},
                            std::pair{&dst.last, &g.probe.last}}) {
        d->sum += src->sum;
        d->abs_sum += src->abs_sum;
        d->cells += src->cells;
      }
    }
    for (size_t i = 0; i < mine.size(); ++i) lp.influence[i] += mine[i];
    if (keep_samples) lp.sample_influence.push_back(std::move(mine));
    ++lp.samples;
    ++done;
    if (progress) progress(done, static_cast<int32_t>(samples.size()));
  }
  for (LengthProfile& lp : p.lengths)
    if (lp.samples > 0)
      for (double& v : lp.influence) v /= lp.samples;
  std::erase_if(p.lengths, [](const LengthProfile& l) { return l.samples == 0; });
  p.loss /= static_cast<double>(samples.size());
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

}  // namespace tessera::plan
