// The Python side of the SIMT build (module `dspark_simt`, `dspark_simt_asan` when sanitized): harness
// settings, per-launch records, and the self-test kernels. dspark_kernels/simt.py wraps it.
#include <torch/extension.h>

#include <string>

#include "dspark_simt/runtime.h"
#include "selftest.cuh"
#include "selftest_mma_sync.cuh"

namespace dspark {
namespace simt {
namespace {

void configure(const std::string& order, uint64_t seed, int poison, int sm_count, bool record, bool access, int arch,
               uint64_t l2_bytes, bool dram) {
  Settings& s = settings();
  if (order == "forward") s.order = Order::kForward;
  else if (order == "reverse") s.order = Order::kReverse;
  else if (order == "random") s.order = Order::kRandom;
  else TORCH_CHECK(false, "simt: order must be 'forward', 'reverse' or 'random', got '", order, "'");
  TORCH_CHECK(poison >= 0 && poison < 256, "simt: poison must be a byte, got ", poison);
  TORCH_CHECK(sm_count >= 1 && sm_count <= 4096, "simt: sm_count must be in [1, 4096], got ", sm_count);
  s.seed = seed;
  s.poison = static_cast<unsigned char>(poison);
  s.sm_count = sm_count;
  s.record = record;
  s.access = access;
  TORCH_CHECK(l2_bytes >= 1, "simt: l2_bytes must be positive, got ", l2_bytes);
  s.l2_bytes = l2_bytes;
  s.dram = dram;
  // The two architectures the launch rules model: per-block opt-in and per-SM shared memory (CUDA C++ Programming
  // Guide, "Compute capabilities", technical specifications table: 227 / 228 KB on 9.0, 163 / 164 KB on 8.0).
  TORCH_CHECK(arch == 80 || arch == 90, "simt: arch must be 80 or 90, got ", arch);
  s.arch = arch;
  s.max_smem_per_block = (arch == 90 ? 227 : 163) * 1024;
  s.smem_per_sm = (arch == 90 ? 228 : 164) * 1024;
}

void set_registers(const std::vector<std::pair<std::string, int>>& table) { settings().registers = table; }

py::dict get_settings() {
  const Settings& s = settings();
  py::dict d;
  d["order"] = s.order == Order::kForward ? "forward" : (s.order == Order::kReverse ? "reverse" : "random");
  d["seed"] = s.seed;
  d["poison"] = static_cast<int>(s.poison);
  d["sm_count"] = s.sm_count;
  d["record"] = s.record;
  d["access"] = s.access;
  d["arch"] = s.arch;
  d["l2_bytes"] = s.l2_bytes;
  d["dram"] = s.dram;
  d["registers"] = s.registers;
  return d;
}

py::list take_records_py() {
  py::list out;
  take_records(
      [](const LaunchRecord& r, void* user) {
        py::dict d;
        d["kernel"] = std::string(r.kernel);
        d["symbol"] = r.symbol;
        d["registers"] = r.registers > 0 ? py::object(py::int_(r.registers)) : py::object(py::none());
        d["ctas_per_sm"] = r.ctas_per_sm;
        d["grid"] = py::make_tuple(r.grid.x, r.grid.y, r.grid.z);
        d["block"] = py::make_tuple(r.block.x, r.block.y, r.block.z);
        d["ctas"] = uint64_t(r.grid.x) * r.grid.y * r.grid.z;
        d["threads"] = uint64_t(r.block.x) * r.block.y * r.block.z;
        d["dynamic_smem"] = r.dynamic_smem;
        d["static_smem"] = r.static_smem;
        d["cooperative"] = r.cooperative;
        d["pdl"] = r.pdl;
        d["bytes_read"] = r.bytes_read;
        d["bytes_written"] = r.bytes_written;
        d["unique_bytes_read"] = r.unique_bytes_read;
        d["unique_bytes_written"] = r.unique_bytes_written;
        d["dram_bytes_read"] = r.dram_estimated ? py::object(py::int_(r.dram_bytes_read)) : py::object(py::none());
        d["barriers"] = r.barriers;
        d["warp_collectives"] = r.warp_collectives;
        d["grid_barriers"] = r.grid_barriers;
        d["mma"] = r.mma;
        d["access_model"] = r.access_model;
        const char* keys[] = {"shared_instructions", "shared_wavefronts", "shared_wavefronts_ideal",
                              "global_instructions", "global_sectors", "global_sectors_ideal"};
        auto counts = [&](const AccessCounts& c) {
          const uint64_t v[] = {c.shared_instructions, c.shared_wavefronts, c.shared_wavefronts_ideal,
                                c.global_instructions, c.global_sectors, c.global_sectors_ideal};
          py::dict out;
          for (int i = 0; i < 6; ++i) out[keys[i]] = v[i];
          return out;
        };
        if (r.access_model) {
          d.attr("update")(counts(r.access));
          d["misaligned_segments"] = r.misaligned_segments;
          d["misaligned_accesses"] = r.misaligned_accesses;
          py::list by_pc;
          for (const auto& e : r.by_pc) by_pc.append(py::make_tuple(e.first, counts(e.second)));
          d["by_pc"] = by_pc;
        } else {
          for (const char* k : keys) d[k] = py::none();
          d["misaligned_segments"] = py::none();
          d["misaligned_accesses"] = py::none();
          d["by_pc"] = py::list();
        }
        static_cast<py::list*>(user)->append(d);
      },
      &out);
  return out;
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "simt selftest: ", name,
              " must be a contiguous float32 CPU tensor");
}

// Runs one self-test kernel: `x` input, `y` output, `aux` a second output; grid/block as given.
void selftest(const std::string& name, const torch::Tensor& x, torch::Tensor& y, torch::Tensor& aux, int grid,
              int block, int variant, double alpha) {
  check_f32(x, "x");
  check_f32(y, "y");
  check_f32(aux, "aux");
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(grid));
  cfg.block = dim3(static_cast<unsigned>(block));
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* ap = aux.data_ptr<float>();
  if (name == "scale_sum") {
    launch("scale_sum_kernel", selftest::scale_sum_kernel, cfg, xp, yp, ap, x.numel(), static_cast<float>(alpha));
  } else if (name == "neighbour") {
    launch("neighbour_kernel", selftest::neighbour_kernel, cfg, xp, yp, variant);
  } else if (name == "divergent_barrier") {
    launch("divergent_barrier_kernel", selftest::divergent_barrier_kernel, cfg, yp, variant);
  } else if (name == "uninitialised") {
    launch("uninitialised_kernel", selftest::uninitialised_kernel, cfg, yp, variant);
  } else if (name == "shuffle_mask") {
    launch("shuffle_mask_kernel", selftest::shuffle_mask_kernel, cfg, yp, variant);
  } else if (name == "oob_read") {
    launch("oob_read_kernel", selftest::oob_read_kernel, cfg, xp, yp, x.numel(), variant);
  } else if (name == "ldmatrix") {
    launch("ldmatrix_kernel", selftest::ldmatrix_kernel, cfg, xp, yp, variant);
  } else if (name == "mma_sync") {
    if (variant == 1) {
      launch("mma_sync_kernel", selftest::mma_sync_kernel<__half>, cfg, xp, yp, variant);
    } else {
      launch("mma_sync_kernel", selftest::mma_sync_kernel<__nv_bfloat16>, cfg, xp, yp, variant);
    }
  } else if (name == "mma_tile") {
    if (variant & 1) {
      launch("mma_tile_kernel", selftest::mma_tile_kernel<__half>, cfg, xp, yp, variant);
    } else {
      launch("mma_tile_kernel", selftest::mma_tile_kernel<__nv_bfloat16>, cfg, xp, yp, variant);
    }
  } else if (name == "bank") {
    launch("bank_kernel", selftest::bank_kernel, cfg, xp, yp, variant);
  } else if (name == "strided") {
    launch("strided_kernel", selftest::strided_kernel, cfg, xp, yp, static_cast<int>(alpha), variant);
  } else if (name == "cp_async") {
    launch("cp_async_kernel", selftest::cp_async_kernel, cfg, xp, yp, variant);
  } else if (name == "reread") {
    cfg.cooperative = variant == 1;
    launch("reread_kernel", selftest::reread_kernel, cfg, xp, yp, x.numel(), variant);
  } else if (name == "pdl") {  // y = 2 x, then (a programmatic dependent launch) aux = y + 1
    launch("pdl_writer_kernel", selftest::pdl_writer_kernel, cfg, xp, yp);
    cfg.pdl = true;
    launch("pdl_reader_kernel", selftest::pdl_reader_kernel, cfg, yp, ap, variant);
  } else if (name == "grid_barrier") {
    cfg.cooperative = variant == 0;  // the broken variant uses the grid barrier in a plain launch
    launch("grid_barrier_kernel", selftest::grid_barrier_kernel, cfg, ap, yp);
  } else {
    TORCH_CHECK(false, "simt selftest: unknown kernel '", name, "'");
  }
}

// The shared-memory launch rules on a self-test kernel: `dynamic` bytes of dynamic shared memory, after
// set_max_dynamic_smem(kernel, attribute) when attribute > 0 (else with the attribute never set).
void launch_rule_case(const std::string& name, int64_t dynamic, int64_t attribute, const torch::Tensor& x,
                      torch::Tensor& y, torch::Tensor& aux) {
  TORCH_CHECK(name == "bank", "simt launch_rule_case: unknown kernel '", name, "'");
  check_f32(x, "x");
  check_f32(y, "y");
  (void)aux;
  auto* kernel = selftest::bank_kernel;
  forget_max_dynamic_smem(reinterpret_cast<const void*>(kernel));
  if (attribute > 0) ::dspark::set_max_dynamic_smem(kernel, static_cast<size_t>(attribute));
  LaunchConfig cfg;
  cfg.block = dim3(32);
  cfg.smem = static_cast<size_t>(dynamic);
  launch("bank_kernel", kernel, cfg, x.data_ptr<float>(), y.data_ptr<float>(), 0);
}

// The split-V self-test: returns (log-sum-exp of logits / T, argmax, Gumbel race winner) per row, and the number of
// chunks per row it used.
py::tuple row_stats(const torch::Tensor& logits, double temperature, const torch::Tensor& rng_key, int64_t min_chunk) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "simt row_stats: logits must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(rng_key.scalar_type() == at::kLong && rng_key.numel() == 2, "simt row_stats: rng_key must be int64 [2]");
  const int64_t rows = logits.size(0), V = logits.size(1);
  const SplitV split = split_v(V, rows, 2 * device_sm_count(), min_chunk);
  auto ws = torch::empty({rows * split.chunks * static_cast<int64_t>(sizeof(selftest::RowPartial))}, torch::kUInt8);
  auto lse = torch::empty({rows}, torch::kFloat32);
  auto am = torch::empty({rows}, torch::kInt64);
  auto race = torch::empty({rows}, torch::kInt64);
  auto* wsp = reinterpret_cast<selftest::RowPartial*>(ws.data_ptr());
  const float t = static_cast<float>(temperature);
  const dspark::rng::Key key = dspark::rng::Key::on_device(rng_key.data_ptr<int64_t>());
  const DType dtype = logits.scalar_type() == at::kFloat      ? DType::kFloat32
                      : logits.scalar_type() == at::kBFloat16 ? DType::kBFloat16
                      : logits.scalar_type() == at::kHalf     ? DType::kFloat16
                                                              : static_cast<DType>(-1);
  DSPARK_DISPATCH_FLOAT(dtype, T, TORCH_CHECK(false, "simt row_stats: logits must be float32, bfloat16 or float16"),
                        selftest::row_stats(reinterpret_cast<const T*>(logits.data_ptr()), rows, V, t, key, min_chunk,
                                            wsp, lse.data_ptr<float>(), am.data_ptr<int64_t>(),
                                            race.data_ptr<int64_t>()));
  return py::make_tuple(lse, am, race, split.chunks);
}

}  // namespace
}  // namespace simt
}  // namespace dspark

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dspark_kernels SIMT harness: CUDA kernels on the CPU (settings, launch records, self-tests)";
  m.def("configure", &dspark::simt::configure, py::arg("order"), py::arg("seed"), py::arg("poison"),
        py::arg("sm_count"), py::arg("record"), py::arg("access"), py::arg("arch") = 90,
        py::arg("l2_bytes") = uint64_t(50) << 20, py::arg("dram") = false);
  m.def("set_registers", &dspark::simt::set_registers, py::arg("table"));
  m.attr("access_model") = dspark::simt::access_model_available();
  m.attr("module_path") = std::string(dspark::simt::module_path());
  m.def("settings", &dspark::simt::get_settings);
  m.def("take_records", &dspark::simt::take_records_py);
  m.def("selftest", &dspark::simt::selftest, py::arg("name"), py::arg("x"), py::arg("y"), py::arg("aux"),
        py::arg("grid"), py::arg("block"), py::arg("variant"), py::arg("alpha") = 1.0);
  m.def("launch_rule_case", &dspark::simt::launch_rule_case, py::arg("name"), py::arg("dynamic"),
        py::arg("attribute"), py::arg("x"), py::arg("y"), py::arg("aux"));
  m.def("row_stats", &dspark::simt::row_stats, py::arg("logits"), py::arg("temperature"), py::arg("rng_key"),
        py::arg("min_chunk"));
#if defined(__SANITIZE_ADDRESS__) && !defined(DSPARK_SIMT_MODEL)  // (the model's instrumentation defines it too)
  m.attr("sanitized") = true;
#else
  m.attr("sanitized") = false;
#endif
}
