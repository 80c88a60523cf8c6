#include "client/src/buffer_table.h"

#include <cstdint>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dos::client {
namespace {

using ::testing::HasSubstr;

class BufferTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    table_.Add("/dos.1.1.1", mem_ + 4096, 4096);
    table_.Add("/dos.1.1.0", mem_, 1024);
  }
  alignas(64) unsigned char mem_[3 * 4096];
  BufferTable table_;
};

TEST_F(BufferTableTest, ResolvesStartMiddleAndEnd) {
  auto r = table_.Resolve(mem_, 1024, "a");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name, "/dos.1.1.0");
  EXPECT_EQ(r->offset, 0u);
  r = table_.Resolve(mem_ + 4096 + 100, 3996, "b");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name, "/dos.1.1.1");
  EXPECT_EQ(r->offset, 100u);
  r = table_.Resolve(mem_ + 8191, 1, "c");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->offset, 4095u);
}

TEST_F(BufferTableTest, RefusesPointersOutsideBuffers) {
  for (const void* p : {static_cast<const void*>(mem_ + 1024),
                        static_cast<const void*>(mem_ + 8192),
                        static_cast<const void*>(mem_ + 3 * 4096 - 1)}) {
    auto r = table_.Resolve(p, 4, "tensor 0 ('w') param");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("tensor 0 ('w') param"));
    EXPECT_THAT(r.status().message(), HasSubstr("dos_buffer_alloc"));
  }
  unsigned char before;
  EXPECT_FALSE(table_.Resolve(&before, 1, "x").ok());
}

TEST_F(BufferTableTest, RefusesRangesOverrunningTheBuffer) {
  auto r = table_.Resolve(mem_ + 1000, 25, "tensor 2 grad");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("only 24 bytes left"));
  EXPECT_THAT(r.status().message(), HasSubstr("/dos.1.1.0"));
}

TEST_F(BufferTableTest, RefusesNullAndForgetsRemoved) {
  EXPECT_THAT(table_.Resolve(nullptr, 4, "p").status().message(), HasSubstr("NULL"));
  table_.Remove("/dos.1.1.0");
  EXPECT_EQ(table_.size(), 1u);
  EXPECT_FALSE(table_.Resolve(mem_, 4, "p").ok());
}

}  // namespace
}  // namespace dos::client
