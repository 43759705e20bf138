// The fixture of the tests typed over a backend (linear_backend_tests.hpp,
// vocab_parallel_linear_backend_tests.hpp): the backend B, set up before each test (a GPU
// backend skips there without a GPU) and torn down after it.
#pragma once

#include <gtest/gtest.h>

namespace xtl {

template <class B>
class backend_test : public ::testing::Test {
 protected:
  void SetUp() override { backend.set_up(); }
  void TearDown() override { backend.tear_down(); }
  B backend;
};

}  // namespace xtl
