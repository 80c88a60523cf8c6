#include "client/src/request_builder.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/strings/str_cat.h"
#include "dos/wire/hparams.h"

namespace dos::client {
namespace {

using ::testing::HasSubstr;

// torch.optim.AdamW's defaults (the C ABI's init functions live in the shared
// library, which these tests do not link).
void InitAdamW(dos_hparams* h) { *h = dos_hparams{1e-3, 0.9, 0.999, 1e-8, 1e-2, 1}; }

class RequestBuilderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    table_.Add("/dos.9.1.0", mem_, sizeof mem_);
    InitAdamW(&group_);
    tensor_ = dos_tensor{"fc.weight", DOS_DTYPE_BF16, mem_, DOS_DTYPE_BF16, mem_ + 256, 64, 0};
  }
  absl::StatusOr<v1::RegisterShardRequest> Build() {
    return BuildRegisterRequest({&tensor_, 1}, {&group_, 1}, 0, table_);
  }
  alignas(64) unsigned char mem_[1024];
  BufferTable table_;
  dos_hparams group_;
  dos_tensor tensor_;
};

TEST_F(RequestBuilderTest, BuildsShmLocations) {
  auto req = Build();
  ASSERT_TRUE(req.ok()) << req.status();
  ASSERT_EQ(req->tensors_size(), 1);
  const auto& t = req->tensors(0);
  EXPECT_EQ(t.name(), "fc.weight");
  EXPECT_EQ(t.param_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(t.numel(), 64u);
  EXPECT_EQ(t.param().shm().name(), "/dos.9.1.0");
  EXPECT_EQ(t.param().shm().offset(), 0u);
  EXPECT_EQ(t.grad().shm().offset(), 256u);
  ASSERT_EQ(req->groups_size(), 1);
  EXPECT_TRUE(req->groups(0).decoupled_weight_decay());
  EXPECT_DOUBLE_EQ(req->groups(0).lr(), 1e-3);
}

TEST_F(RequestBuilderTest, DescribesTensorsWithTheSharedType) {
  TensorDesc d = DescribeTensor(tensor_, 0);
  EXPECT_EQ(d.name, "fc.weight");
  EXPECT_EQ(d.param_dtype, DType::kBF16);
  EXPECT_EQ(d.grad_dtype, DType::kBF16);
  EXPECT_EQ(d.numel, 64u);
  EXPECT_EQ(d.group, 0u);
  EXPECT_EQ(d.step, 0);
  tensor_.name = nullptr;
  EXPECT_EQ(DescribeTensor(tensor_, 3).name, "tensor3");
  // The request carries the same description.
  auto req = Build();
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->tensors(0).name(), "tensor0");
}

TEST_F(RequestBuilderTest, RejectsBadDtypeNamingTheTensor) {
  tensor_.grad_dtype = static_cast<dos_dtype>(7);
  auto req = Build();
  ASSERT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(req.status().message(), HasSubstr("tensor 0 ('fc.weight') grad"));
  EXPECT_THAT(req.status().message(), HasSubstr("unsupported dtype 7"));
}

TEST_F(RequestBuilderTest, RejectsOverrunAndOverlapAndGroup) {
  tensor_.numel = 400;  // 800 bytes of grad from offset 256 overruns 1024
  EXPECT_THAT(Build().status().message(), HasSubstr("grad"));
  tensor_.numel = 64;
  tensor_.grad = mem_ + 64;
  EXPECT_THAT(Build().status().message(), HasSubstr("overlap"));
  tensor_.grad = mem_ + 256;
  tensor_.group = 1;
  EXPECT_THAT(Build().status().message(), HasSubstr("names group 1"));
  tensor_.group = 0;
  tensor_.numel = 0;
  EXPECT_THAT(Build().status().message(), HasSubstr("0 elements"));
}

TEST_F(RequestBuilderTest, RejectsBadHyperparameters) {
  group_.beta1 = 1.0;
  EXPECT_THAT(Build().status().message(), HasSubstr("beta1"));
  InitAdamW(&group_);
  group_.lr = NAN;
  EXPECT_THAT(Build().status().message(), HasSubstr("lr"));
  EXPECT_EQ(BuildRegisterRequest({&tensor_, 1}, {}, 0, table_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildRegisterRequest({}, {&group_, 1}, 0, table_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The client checks hyperparameters with dosd's own function
// (ValidateGroupStepParams, which dosd's ValidateShardSpec and step flow
// call), so what it refuses and the words it uses are dosd's.
TEST_F(RequestBuilderTest, HyperparametersFollowTheDaemonsContract) {
  group_.eps = 0;  // torch accepts it, so do client and daemon
  EXPECT_TRUE(Build().ok()) << Build().status();
  dos_step_args args{&group_, 1, /*grad_scale=*/1.0, /*clip_coef=*/0.0, /*gradients_checked=*/0,
                     /*skip_tensors=*/nullptr, /*num_skip_tensors=*/0};
  StepRequest req{};
  EXPECT_TRUE(FillStepRequest(args, 1, 1, &req).ok());
  EXPECT_EQ(req.groups[0].eps, 0.0);

  struct Case {
    void (*bad)(dos_hparams*);
    const char* want;
  };
  const Case cases[] = {
      {[](dos_hparams* h) { h->lr = -1; }, "group 0 lr = -1 is invalid; it must be finite and >= 0"},
      {[](dos_hparams* h) { h->beta1 = 1; }, "group 0 beta1 = 1 is invalid; it must be in [0, 1)"},
      {[](dos_hparams* h) { h->beta2 = -0.5; },
       "group 0 beta2 = -0.5 is invalid; it must be in [0, 1)"},
      {[](dos_hparams* h) { h->eps = -1e-8; },
       "group 0 eps = -1e-08 is invalid; it must be finite and >= 0"},
  };
  for (const Case& c : cases) {
    InitAdamW(&group_);
    c.bad(&group_);
    const absl::Status reg = Build().status();
    EXPECT_EQ(reg.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(reg.message(), absl::StrCat("register: ", c.want));
    EXPECT_EQ(reg, ValidateGroupStepParams(StepParams(group_), 0, "register"));
    const absl::Status step = FillStepRequest(args, 1, 1, &req);
    EXPECT_EQ(step.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(step.message(), absl::StrCat("step: ", c.want));
  }
}

TEST(FillStepRequestTest, CopiesGroupsAndChecksCount) {
  std::vector<dos_hparams> groups(2);
  InitAdamW(&groups[0]);
  InitAdamW(&groups[1]);
  groups[1].lr = 5e-4;
  dos_step_args args{groups.data(), 2, /*grad_scale=*/1.0, /*clip_coef=*/1.0,
                     /*gradients_checked=*/1, /*skip_tensors=*/nullptr, /*num_skip_tensors=*/0};
  StepRequest req{};
  ASSERT_TRUE(FillStepRequest(args, 2, 5, &req).ok());
  EXPECT_EQ(req.num_groups, 2u);
  EXPECT_EQ(req.flags, kStepGradientsChecked);
  EXPECT_DOUBLE_EQ(req.groups[1].lr, 5e-4);
  EXPECT_DOUBLE_EQ(req.grad_scale, 1.0);
  EXPECT_THAT(FillStepRequest(args, 3, 5, &req).message(), HasSubstr("3 were registered"));
  args.grad_scale = 0;
  EXPECT_THAT(FillStepRequest(args, 2, 5, &req).message(), HasSubstr("grad_scale"));
}

// Tensors without a gradient: a bit each in `skip` with kStepSkipTensors;
// none given leaves the mask clear and the flag off; an index past the
// registered tensors (or past the mask) is refused with both numbers.
TEST(FillStepRequestTest, SkippedTensorsBecomeTheMask) {
  dos_hparams group;
  InitAdamW(&group);
  const uint32_t skip[] = {1, 4, 70};
  dos_step_args args{&group, 1, /*grad_scale=*/1.0, /*clip_coef=*/1.0, /*gradients_checked=*/0,
                     skip, 3};
  StepRequest req{};
  std::memset(req.skip, 0xff, sizeof(req.skip));  // a previous step's mask is cleared
  ASSERT_TRUE(FillStepRequest(args, 1, 100, &req).ok());
  EXPECT_EQ(req.flags, kStepSkipTensors);
  EXPECT_EQ(req.skip[0], (uint64_t{1} << 1) | (uint64_t{1} << 4));
  EXPECT_EQ(req.skip[1], uint64_t{1} << 6);
  for (uint32_t i = 0; i < 100; ++i) {
    EXPECT_EQ(SkipsTensor(req, i), i == 1 || i == 4 || i == 70) << i;
  }
  EXPECT_THAT(FillStepRequest(args, 1, 70, &req).message(),
              HasSubstr("skip_tensors[2] = 70 but 70 tensors are registered"));
  args.num_skip_tensors = 0;
  std::memset(req.skip, 0xff, sizeof(req.skip));
  ASSERT_TRUE(FillStepRequest(args, 1, 100, &req).ok());
  EXPECT_EQ(req.flags, 0u);
  EXPECT_FALSE(SkipsTensor(req, 1));
  EXPECT_EQ(req.skip[0], 0u);
}

}  // namespace
}  // namespace dos::client
