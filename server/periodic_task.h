// A task run on its own thread every period of real time until its owner goes: the driver of
// work whose logic runs on an injected clock (the workers' lease sweep), so that tests call the
// work directly and only the binaries wait.
#pragma once

#include <functional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace dsa {

/// Runs `task` every `period` (> 0) of real time, first after one period, until destroyed; the
/// destructor stops the thread and waits for a run in progress to end.
class PeriodicTask {
 public:
  PeriodicTask(absl::Duration period, std::function<void()> task)
      : thread_([this, period, task = std::move(task)] {
          while (!stop_.WaitForNotificationWithTimeout(period)) task();
        }) {}
  PeriodicTask(const PeriodicTask&) = delete;
  PeriodicTask& operator=(const PeriodicTask&) = delete;
  ~PeriodicTask() {
    stop_.Notify();
    thread_.join();
  }

 private:
  absl::Notification stop_;  // declared before thread_, which reads it
  std::thread thread_;
};

}  // namespace dsa
