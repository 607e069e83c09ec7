"""ppe's MNIST example (example/mnist.py of pytorch-pfn-extras) migrated by changing only its two
ppe imports, on synthetic 28x28 digits instead of the download, and without the extensions
snapkeep does not ship (ParameterStatistics, VariableStatisticsPlot, PlotReport, Slack; the
TensorBoard LogReport becomes a JSON-lines one) and ppe.nn.ensure.

Test hooks (environment variables): ``EPOCHS`` (default 4), ``WRITER`` (``simple``: the
manager's default writer, or ``thread``: ``ppe.writing.ThreadWriter``), ``KILL_AT_ITERATION``
(SIGKILL this process right after that iteration), ``SNAPKEEP_EXAMPLE_OUT`` (output directory).
"""

import os
import signal

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import snapkeep as ppe  # was: import pytorch_pfn_extras as ppe
import snapkeep.training.extensions as extensions  # was: pytorch_pfn_extras.training.extensions

KILL_AT_ITERATION = int(os.environ.get("KILL_AT_ITERATION", "0"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5, 1)
        self.conv2 = nn.Conv2d(4, 8, 5, 1)
        self.fc1 = nn.Linear(4 * 4 * 8, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 2)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 2)
        x = x.flatten(start_dim=1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_digits(n, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 10, (n,), generator=g)
    data = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    data[torch.arange(n), 0, 2 + 2 * target, 4:24] += 1.0  # a bar whose row is the label
    return torch.utils.data.TensorDataset(data, target)


def train(manager, args, model, device, train_loader):
    while not manager.stop_trigger:
        model.train()
        for _, (data, target) in enumerate(train_loader):
            with manager.run_iteration(step_optimizers=["main"]):
                data, target = data.to(device), target.to(device)
                output = model(data)
                loss = F.nll_loss(output, target)
                ppe.reporting.report({"train/loss": loss.item()})
                loss.backward()
            if manager.iteration == KILL_AT_ITERATION:  # test hook: die without clean-up
                os.kill(os.getpid(), signal.SIGKILL)


def test(args, model, device, data, target):
    model.eval()
    data, target = data.to(device), target.to(device)
    output = model(data)
    test_loss = F.nll_loss(output, target, reduction="mean").item()
    ppe.reporting.report({"val/loss": test_loss})
    pred = output.argmax(dim=1, keepdim=True)
    correct = pred.eq(target.view_as(pred)).sum().item()
    ppe.reporting.report({"val/acc": correct / len(data)})


def main():
    args = None
    torch.manual_seed(1)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    out = os.environ.get("SNAPKEEP_EXAMPLE_OUT", "result")
    train_loader = torch.utils.data.DataLoader(synthetic_digits(64, 0), batch_size=16,
                                               shuffle=True)
    test_loader = torch.utils.data.DataLoader(synthetic_digits(32, 1), batch_size=16,
                                              shuffle=True)

    model = Net()
    model.to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    writer = None
    if os.environ.get("WRITER", "simple") == "thread":
        writer = ppe.writing.ThreadWriter(out_dir=out)

    my_extensions = [
        extensions.LogReport(),
        extensions.LogReport(filename="log_iter.jsonl", trigger=(3, "iteration")),
        extensions.ProgressBar(update_interval=2),
        extensions.observe_lr(optimizer=optimizer),
        extensions.Evaluator(
            test_loader, model,
            eval_func=lambda data, target: test(args, model, device, data, target),
            progress_bar=True),
        extensions.PrintReport(["epoch", "iteration", "train/loss", "lr", "val/loss",
                                "val/acc"]),
        extensions.LRScheduler(scheduler),
        extensions.snapshot(autoload=True, n_retains=2, writer=writer),
    ]
    manager = ppe.training.ExtensionsManager(
        model, optimizer, int(os.environ.get("EPOCHS", "4")),
        extensions=my_extensions,
        iters_per_epoch=len(train_loader),
        out_dir=out)
    print(f"starting at iteration {manager.iteration}", flush=True)
    train(manager, args, model, device, train_loader)
    print(f"finished at iteration {manager.iteration}", flush=True)


if __name__ == "__main__":
    main()
