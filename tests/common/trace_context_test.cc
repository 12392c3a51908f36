// Tests of the W3C traceparent codec and the thread's current trace context.
#include "common/trace_context.h"

#include <set>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace dsa {
namespace {

TEST(TraceContextTest, ParsesAndFormatsTheW3cExample) {
  const std::string value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  const auto parsed = ParseTraceparent(value);
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(parsed->parent_id, "00f067aa0ba902b7");
  EXPECT_EQ(parsed->flags, 1);
  EXPECT_EQ(parsed->ToTraceparent(), value);
  const auto unsampled =
      ParseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
  ASSERT_TRUE(unsampled.has_value());
  EXPECT_EQ(unsampled->flags, 0);
}

TEST(TraceContextTest, RefusesWhatTheSpecificationRefuses) {
  for (const char* bad : {
           "",
           "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",   // another version
           "00-00000000000000000000000000000000-00f067aa0ba902b7-01",   // all-zero trace id
           "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",   // all-zero parent id
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",   // upper case
           "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",    // 31 digits
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",   // flags not hex
           "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",   // separator
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x"  // trailing data
       }) {
    EXPECT_FALSE(ParseTraceparent(bad).has_value()) << bad;
  }
}

TEST(TraceContextTest, NewTracesAndChildSpansHaveFreshNonZeroIds) {
  std::set<std::string> traces, spans;
  for (int i = 0; i < 100; ++i) {
    const TraceContext context = NewTraceContext();
    ASSERT_TRUE(ParseTraceparent(context.ToTraceparent()).has_value()) << context.ToTraceparent();
    traces.insert(context.trace_id);
    const TraceContext child = context.Child();
    EXPECT_EQ(child.trace_id, context.trace_id);
    EXPECT_NE(child.parent_id, context.parent_id);
    spans.insert(child.parent_id);
  }
  EXPECT_EQ(traces.size(), 100u);
  EXPECT_EQ(spans.size(), 100u);
}

TEST(TraceContextTest, TheCurrentContextIsPerThreadAndScoped) {
  EXPECT_FALSE(CurrentTraceContext().has_value());
  const TraceContext outer = NewTraceContext();
  {
    const ScopedTraceContext scoped(outer);
    EXPECT_EQ(CurrentTraceContext()->trace_id, outer.trace_id);
    {
      const ScopedTraceContext inner(std::nullopt);
      EXPECT_FALSE(CurrentTraceContext().has_value());
    }
    EXPECT_EQ(CurrentTraceContext()->trace_id, outer.trace_id);
    std::thread([] { EXPECT_FALSE(CurrentTraceContext().has_value()); }).join();
  }
  EXPECT_FALSE(CurrentTraceContext().has_value());
}

}  // namespace
}  // namespace dsa
