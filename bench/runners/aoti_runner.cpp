// Runs an AOTInductor package from C++, with no Python in the process: how a
// package is shipped, and the way that works on the benchmark's GPU machine,
// where torch 2.11's Python loader (aoti_load_package) crashes for every
// package, plain PyTorch and CPU ones included (docs/notes/aoti.md).
//
//   aoti_runner PACKAGE.pt2 INPUTS.pt OUTPUTS.pt DEVICE [REPEATS] [CALLS]
//
// INPUTS.pt: torch.save of a list of tensors, the package's flat inputs in
// order (bench/runners/aoti.py writes it). OUTPUTS.pt: the first call's outputs, a
// tuple (torch.load reads it). With REPEATS > 0, also times REPEATS rounds of
// CALLS calls each (default 3 x 10), the device synchronized by reading one
// output value back after each round. Prints one JSON line:
//   {"load_s": ..., "first_call_ms": ..., "ms_runs": [per-call ms of each round]}
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

// Waits for the device: reading a value back synchronizes the stream the package ran on.
void wait_for(const std::vector<at::Tensor>& outputs) {
  if (!outputs.empty()) outputs[0].flatten()[0].item<float>();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: aoti_runner PACKAGE.pt2 INPUTS.pt OUTPUTS.pt DEVICE [REPEATS] [CALLS]\n";
    return 2;
  }
  const std::string package = argv[1], inputs_path = argv[2], outputs_path = argv[3];
  const at::Device device(argv[4]);
  const int repeats = argc > 5 ? std::atoi(argv[5]) : 3, calls = argc > 6 ? std::atoi(argv[6]) : 10;

  std::vector<at::Tensor> inputs;
  for (const auto& value : torch::jit::pickle_load(read_file(inputs_path)).toList()) {
    inputs.push_back(value.get().toTensor().to(device));
  }

  auto start = Clock::now();
  torch::inductor::AOTIModelPackageLoader loader(package);
  const double load_s = seconds_since(start);

  start = Clock::now();
  std::vector<at::Tensor> outputs = loader.run(inputs);
  wait_for(outputs);
  const double first_call_ms = seconds_since(start) * 1e3;

  std::vector<c10::IValue> saved;  // a tuple: torch.load's weights-only unpickler takes it (typed lists it refuses)
  for (const auto& t : outputs) saved.emplace_back(t.to(at::kCPU));
  const std::vector<char> bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(saved)));
  std::ofstream(outputs_path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));

  std::ostringstream runs;
  for (int r = 0; r < repeats; ++r) {
    start = Clock::now();
    for (int c = 0; c < calls; ++c) outputs = loader.run(inputs);
    wait_for(outputs);
    runs << (r ? ", " : "") << seconds_since(start) * 1e3 / calls;
  }
  std::cout << "{\"load_s\": " << load_s << ", \"first_call_ms\": " << first_call_ms << ", \"ms_runs\": ["
            << runs.str() << "]}" << std::endl;
  return 0;
}
